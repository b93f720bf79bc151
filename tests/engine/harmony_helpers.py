"""gpt-oss's harmony format for the tests, without the Hub: a chat template of that format,
a character-level tokenizer with harmony's special tokens, and a tiny gpt-oss checkpoint
whose greedy answer is known exactly (``save_scripted_gptoss``).

``HARMONY_TEMPLATE`` is ferry's own Jinja rendering of the prompt format that gpt-oss's
published ``chat_template.jinja`` writes (the reference; its text is not copied here): a
system message with the model identity, knowledge cutoff, date and ``Reasoning:
{reasoning_effort}`` (default ``medium``), the valid channels and, with tools, where calls
go; a developer message with the first system/developer message as ``# Instructions`` and
the tools as a TypeScript-like ``namespace functions``; user turns; assistant turns as the
``final`` channel (earlier reasoning dropped), or, before a tool call, the reasoning
(``thinking``) in ``analysis`` and the call as ``to=functions.NAME`` in ``commentary``
ending ``<|call|>``; tool results as messages from ``functions.NAME``; the generation
prompt ``<|start|>assistant``.

The scripted checkpoint (as ``tests/e2e/scripted_model.py``, for gpt-oss): attention and
expert outputs zeroed, so the last hidden state is the token's one-hot embedding and the LM
head maps each token to its successor. The prompt ends with ``assistant`` (last character
``t``), so every chat answer is::

    <|channel|>analysis<|message|>ponder<|end|><|start|>assistant<|channel|>commentary
    to=functions.get <|constrain|>json<|message|>{"q": 1}<|call|>

(``CALL_HEAD`` is one token), and with ``CALL_HEAD`` banned (``logit_bias``) the second
choice after ``<|start|>``: ``...<|start|>assistant<|channel|>final<|message|>Sure<|return|>``.
"""

from __future__ import annotations

import string

SPECIALS = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
            "<|constrain|>", "<|return|>", "<|call|>"]
CALL_HEAD = "assistant<|channel|>commentary to=functions.get <|constrain|>json<|message|>"
FINAL_HEAD = "assistant<|channel|>final<|message|>"
ARGS = '{"q": 1}'
ADDED = ["analysis", "ponder", CALL_HEAD, FINAL_HEAD, ARGS, "Sure"]
#: token -> its greedy successor; every other token is followed by <|return|>
SCRIPT = {"t": "<|channel|>", "<|channel|>": "analysis", "analysis": "<|message|>",
          "<|message|>": "ponder", "ponder": "<|end|>", "<|end|>": "<|start|>",
          "<|start|>": CALL_HEAD, CALL_HEAD: ARGS, ARGS: "<|call|>",
          FINAL_HEAD: "Sure"}
#: token -> the second choice
SECOND = {"<|start|>": FINAL_HEAD}
HIDDEN = 128

HARMONY_TEMPLATE = r"""
{%- macro ts(spec) -%}
  {%- if spec.enum is defined and spec.enum -%}"{{ spec.enum | join('" | "') }}"
  {%- elif spec.type == "string" -%}string
  {%- elif spec.type in ["number", "integer"] -%}number
  {%- elif spec.type == "boolean" -%}boolean
  {%- elif spec.type == "array" -%}
    {%- if spec["items"] is defined -%}{{ ts(spec["items"]) }}[]{%- else -%}any[]{%- endif -%}
  {%- elif spec.type == "object" and spec.properties is defined and spec.properties -%}
    {{ "{\n" }}
    {%- for key, sub in spec.properties.items() -%}
      {{ key }}{% if key not in (spec.required or []) %}?{% endif %}: {{ ts(sub) }}
      {%- if not loop.last %}, {% endif -%}
    {%- endfor -%}
    {{ "}" }}
  {%- elif spec.type == "object" -%}object
  {%- else -%}any
  {%- endif -%}
{%- endmacro -%}

{%- macro functions_namespace(tools) -%}
  {{ "## functions\n\nnamespace functions {\n\n" }}
  {%- for entry in tools -%}
    {%- set fn = entry.function if entry.function is defined else entry -%}
    {%- if fn.description %}{{ "// " + fn.description + "\n" }}{% endif -%}
    {%- set params = fn.parameters or {} -%}
    {%- if params.properties is defined and params.properties -%}
      {{ "type " + fn.name + " = (_: {\n" }}
      {%- for key, spec in params.properties.items() -%}
        {%- if spec.description %}{{ "// " + spec.description + "\n" }}{% endif -%}
        {{ key }}{% if key not in (params.required or []) %}?{% endif %}: {{ ts(spec) }}
        {%- if spec.default is defined %}, // default: {{ spec.default | tojson }}{% else %},{% endif %}
        {{- "\n" -}}
      {%- endfor -%}
      {{ "}) => any;\n\n" }}
    {%- else -%}
      {{ "type " + fn.name + " = () => any;\n\n" }}
    {%- endif -%}
  {%- endfor -%}
  {{ "} // namespace functions" }}
{%- endmacro -%}

{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort else "medium" -%}
{%- set identity = model_identity if model_identity is defined else "You are ChatGPT, a large language model trained by OpenAI." -%}
{%- set today = current_date if current_date is defined else strftime_now("%Y-%m-%d") -%}
{{- "<|start|>system<|message|>" + identity + "\nKnowledge cutoff: 2024-06\nCurrent date: " + today + "\n\nReasoning: " + effort + "\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message." -}}
{%- if tools %}{{ "\nCalls to these tools must go to the commentary channel: 'functions'." }}{% endif -%}
{{- "<|end|>" -}}

{%- if messages and messages[0].role in ["system", "developer"] -%}
  {%- set instructions = messages[0].content -%}
  {%- set rest = messages[1:] -%}
{%- else -%}
  {%- set instructions = "" -%}
  {%- set rest = messages -%}
{%- endif -%}
{%- if instructions or tools -%}
  {{- "<|start|>developer<|message|>" -}}
  {%- if instructions %}{{ "# Instructions\n\n" + instructions + "\n\n" }}{% endif -%}
  {%- if tools %}{{ "# Tools\n\n" + functions_namespace(tools) }}{% endif -%}
  {{- "<|end|>" -}}
{%- endif -%}

{%- set state = namespace(callee="") -%}
{%- for m in rest -%}
  {%- if m.role == "user" -%}
    {{- "<|start|>user<|message|>" + m.content + "<|end|>" -}}
  {%- elif m.role == "assistant" and m.tool_calls is defined and m.tool_calls -%}
    {%- set later = namespace(final=false) -%}
    {%- for n in rest[loop.index:] -%}
      {%- if n.role == "assistant" and not (n.tool_calls is defined and n.tool_calls) -%}
        {%- set later.final = true -%}
      {%- endif -%}
    {%- endfor -%}
    {%- set reasoning = m.thinking if m.thinking is defined and m.thinking else m.content -%}
    {%- if reasoning and not later.final -%}
      {{- "<|start|>assistant<|channel|>analysis<|message|>" + reasoning + "<|end|>" -}}
    {%- endif -%}
    {%- for call in m.tool_calls -%}
      {%- set fn = call.function if call.function is defined else call -%}
      {{- "<|start|>assistant to=functions." + fn.name + "<|channel|>commentary json<|message|>" -}}
      {{- (fn.arguments if fn.arguments is string else fn.arguments | tojson) + "<|call|>" -}}
      {%- set state.callee = fn.name -%}
    {%- endfor -%}
  {%- elif m.role == "assistant" -%}
    {%- if loop.last and not add_generation_prompt -%}
      {%- if m.thinking is defined and m.thinking -%}
        {{- "<|start|>assistant<|channel|>analysis<|message|>" + m.thinking + "<|end|>" -}}
      {%- endif -%}
      {{- "<|start|>assistant<|channel|>final<|message|>" + m.content + "<|return|>" -}}
    {%- else -%}
      {{- "<|start|>assistant<|channel|>final<|message|>" + m.content + "<|end|>" -}}
    {%- endif -%}
  {%- elif m.role == "tool" -%}
    {%- if not state.callee -%}
      {{- raise_exception("a tool message needs an earlier assistant tool call") -}}
    {%- endif -%}
    {%- set callee = m.name if m.name is defined and m.name else state.callee -%}
    {{- "<|start|>functions." + callee + " to=assistant<|channel|>commentary<|message|>" + m.content | tojson + "<|end|>" -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{ "<|start|>assistant" }}{% endif -%}
"""


def harmony_tokenizer(added: list[str] = ()):
    """A ``PreTrainedTokenizerFast``: one token per printable character, harmony's special
    tokens (``<|return|>`` the EOS, ``<|endoftext|>`` the pad) and ``added`` as ordinary
    tokens; its chat template is ``HARMONY_TEMPLATE``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for c in string.printable:
        if c not in "\x0b\x0c":
            vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|return|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = HARMONY_TEMPLATE
    return fast


def save_scripted_gptoss(path) -> dict[str, int]:
    """Save the scripted gpt-oss checkpoint (float experts) and its tokenizer to ``path``;
    returns the ids of the script's tokens."""
    import torch
    from transformers import AutoModelForCausalLM, GptOssConfig

    tok = harmony_tokenizer(ADDED)
    vocab = len(tok)
    assert vocab <= HIDDEN
    ids = {t: tok.convert_tokens_to_ids(t) for t in [*SPECIALS, *ADDED, "t"]}
    cfg = GptOssConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=32, head_dim=16,
                       num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                       num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                       max_position_embeddings=2048, eos_token_id=ids["<|return|>"],
                       pad_token_id=ids["<|endoftext|>"], bos_token_id=None,
                       tie_word_embeddings=False, rms_norm_eps=1e-6)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    logits = torch.zeros(vocab, vocab)                      # [current token, next token]
    logits[:, ids["<|return|>"]] = 10.0
    for a, b in SCRIPT.items():
        logits[ids[a]] = 0.0
        logits[ids[a], ids[b]] = 10.0
    for a, b in SECOND.items():
        logits[ids[a], ids[b]] = 5.0
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.embed_tokens.weight[:, :vocab] = torch.eye(vocab)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
        # the hidden state of token i after the final norm: sqrt(HIDDEN) * e_i
        model.lm_head.weight[:, :vocab] = logits.T / HIDDEN ** 0.5
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return ids
