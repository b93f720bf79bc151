"""A tiny random Qwen2.5-VL checkpoint for the tests: a 2-layer Qwen2 language model
(hidden 64, head 16, ``mrope_section`` [2, 3, 3]) and a 3-block vision tower (patch 14,
merge 2, windows of 2x2 merged tokens, block 1 full attention), weights drawn with std 0.2
(smaller ones leave the first tokens blind to the image), beside a character-level tokenizer
with Qwen's vision tokens and a chat template that writes
``<|vision_start|><|image_pad|><|vision_end|>`` per image part, and a PIL image processor
(28-pixel units, 4 to 16 tokens per image)."""

from __future__ import annotations

import string

import torch

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
VOCAB = 264
IMAGE_TOKEN_ID = 257
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def config():
    from transformers import Qwen2_5_VLConfig

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [2, 3, 3]},
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2,
                  out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                            image_token_id=IMAGE_TOKEN_ID, video_token_id=259,
                            vision_start_token_id=256, vision_end_token_id=258,
                            tie_word_embeddings=False)


def config3():
    """Qwen3-VL: a 3-layer Qwen3 language model (q/k norms, interleaved M-RoPE [2, 3, 3]),
    a 3-block tower (patch 16, a 4x4 learned position table, DeepStack after blocks 0
    and 1)."""
    from transformers import Qwen3VLConfig

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [2, 3, 3], "mrope_interleaved": True},
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2,
                  out_hidden_size=64, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=16,
                  deepstack_visual_indexes=[0, 1])
    return Qwen3VLConfig(text_config=text, vision_config=vision,
                         image_token_id=IMAGE_TOKEN_ID, video_token_id=259,
                         vision_start_token_id=256, vision_end_token_id=258,
                         tie_word_embeddings=False)


def config35(moe: bool = False):
    """Qwen3.5: a 4-layer hybrid language model (Gated DeltaNet layers 0 and 2, gated full
    attention in 1 and 3; head 16 with a partial rotary of 0.5: interleaved M-RoPE
    [2, 1, 1] over its 8 rotated dims) and a 2-block tower (patch 16, a 4x4 learned
    position table, no DeepStack). ``moe``: Qwen3.5-MoE's, every layer 4 experts (top-2)
    and a gated shared expert."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=1024, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                linear_conv_kernel_dim=4,
                layer_types=["linear_attention", "full_attention"] * 2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                                 "mrope_interleaved": True},
                bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    if moe:
        del text["intermediate_size"]
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=48)
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                  out_hidden_size=64, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=16)
    return (Qwen3_5MoeConfig if moe else Qwen3_5Config)(text_config=text, vision_config=vision,
                         image_token_id=IMAGE_TOKEN_ID, video_token_id=259,
                         vision_start_token_id=256, vision_end_token_id=258,
                         tie_word_embeddings=False)


def save_tokenizer(path):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for c in string.printable + "".join(chr(i) for i in range(0xA1, 0x180)):
        if len(vocab) < 256 and c not in "\x0b\x0c":
            vocab.setdefault(c, len(vocab))
    for i, t in enumerate(VISION_TOKENS):
        vocab[t] = 256 + i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True) for t in VISION_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def image_processor(patch: int = 14):
    """The PIL image processor: 4 to 16 tokens per image (units of ``2 * patch`` pixels)."""
    from transformers import Qwen2VLImageProcessorPil

    unit = 2 * patch
    return Qwen2VLImageProcessorPil(patch_size=patch, min_pixels=unit * unit * 4,
                                    max_pixels=unit * unit * 16)


def save_tiny(path, seed: int = 5, std: float = 0.2, arch: str = "qwen2_5_vl"):
    """Build, randomise (norms 1 + 0.1 N(0, 1), the rest ``std`` N(0, 1)) and save the
    checkpoint (``arch``: ``qwen2_5_vl``, ``qwen3_vl``, ``qwen3_5`` or ``qwen3_5_moe``), tokenizer and image processor to
    ``path``; returns the HF model (eval)."""
    import transformers as T

    torch.manual_seed(seed)
    cls, cfg = {"qwen3_vl": (T.Qwen3VLForConditionalGeneration, config3),
                "qwen3_5": (T.Qwen3_5ForConditionalGeneration, config35),
                "qwen3_5_moe": (T.Qwen3_5MoeForConditionalGeneration,
                                lambda: config35(moe=True)),
                "qwen2_5_vl": (T.Qwen2_5_VLForConditionalGeneration, config)}[arch]
    cfg = cfg()
    hf = cls(cfg).to(torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name or "ln_q" in name else std * noise)
            if arch.startswith("qwen3_5") and name.endswith("A_log"):  # decays exp(A) below ~1
                p.copy_(0.1 * noise)
    hf.save_pretrained(path)
    save_tokenizer(path)
    image_processor(14 if arch == "qwen2_5_vl" else 16).save_pretrained(path)
    return hf


def images():
    """Generated images: solid colours, a gradient, different sizes and aspect ratios."""
    from PIL import Image

    red = Image.new("RGB", (56, 56), (220, 20, 20))
    blue = Image.new("RGB", (84, 56), (10, 30, 230))
    grad = Image.new("RGB", (84, 84))
    grad.putdata([(3 * x, 3 * y, (x + y) % 256) for y in range(84) for x in range(84)])
    tall = Image.new("RGB", (40, 100), (30, 200, 90))
    return {"red": red, "blue": blue, "gradient": grad, "tall": tall}


# ---- Gemma 3 (Gemma3ForConditionalGeneration) -------------------------------------------

GEMMA3_TOKENS = ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]
GEMMA3_IMAGE_ID = 257
GEMMA3_TEMPLATE = (
    "<s>{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    "<start_of_image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def gemma3_config():
    """A 6-layer Gemma 3 language model (layers 2 and 5 global, windows of 8 tokens: fewer
    than an image's 16) and a 2-layer SigLIP (56-pixel images, patch 7: 8x8 patches pooled
    by 2 to 16 tokens)."""
    import transformers as T
    from gemma_helpers import COMMON, GEMMA3

    text = {**COMMON, **GEMMA3, "vocab_size": VOCAB}
    vision = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
              "num_attention_heads": 2, "image_size": 56, "patch_size": 7,
              "vision_use_head": False}
    return T.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16,
                          boi_token_index=256, image_token_index=GEMMA3_IMAGE_ID,
                          eoi_token_index=258, attn_implementation="eager")


def gemma3_processor():
    """transformers' Gemma 3 image processor (PIL) for 56-pixel images."""
    from transformers import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": 56, "width": 56})


def save_gemma3(path, seed: int = 5, std: float = 0.2):
    """Build, randomise (as :func:`save_tiny`) and save the Gemma 3 checkpoint with a
    tokenizer holding its image tokens and a template writing ``<start_of_image>``, and the
    image processor; returns the HF model (eval)."""
    import transformers as T

    torch.manual_seed(seed)
    hf = T.Gemma3ForConditionalGeneration(gemma3_config()).to(torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name and "layer_norm" not in name and "layernorm" not in name:
                p.copy_(0.1 * noise)            # Gemma's (1 + w) norms
            elif "layer_norm" in name or "layernorm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * noise)
            else:
                p.copy_(std * noise)
    hf.save_pretrained(path)
    save_gemma3_tokenizer(path)
    gemma3_processor().save_pretrained(path)
    return hf


def save_gemma3_tokenizer(path):
    """The character-level tokenizer with Gemma 3's image and turn tokens and a chat
    template writing ``<start_of_image>`` per image part."""
    import transformers as T
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for c in string.printable + "".join(chr(i) for i in range(0xA1, 0x180)):
        if len(vocab) < 253 and c not in "\x0b\x0c":
            vocab.setdefault(c, len(vocab))
    for t in ["<start_of_turn>", "<end_of_turn>", "<unused>"]:
        vocab[t] = len(vocab)
    for i, t in enumerate(GEMMA3_TOKENS):
        vocab[t] = 256 + i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    special = GEMMA3_TOKENS + ["<start_of_turn>", "<end_of_turn>", "<s>"]
    tok.add_special_tokens([AddedToken(t, special=True) for t in special])
    fast = T.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                     pad_token="<pad>")
    fast.chat_template = GEMMA3_TEMPLATE
    fast.save_pretrained(path)


def gemma3_images():
    """Generated 56- and 112-pixel images (the processor resizes them to 56): solid
    colours, a gradient."""
    from PIL import Image

    red = Image.new("RGB", (56, 56), (220, 20, 20))
    blue = Image.new("RGB", (112, 112), (10, 30, 230))
    grad = Image.new("RGB", (112, 84))
    grad.putdata([(2 * x, 3 * y, (x + y) % 256) for y in range(84) for x in range(112)])
    return {"red": red, "blue": blue, "gradient": grad}


def png(size=(56, 56), colour=(200, 10, 10)) -> bytes:
    """A solid-colour PNG image of ``size`` (width, height) pixels (pillow)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    """``data:image/png;base64,...`` of PNG bytes."""
    import base64

    return "data:image/png;base64," + base64.b64encode(data).decode()
