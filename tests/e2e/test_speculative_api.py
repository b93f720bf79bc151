"""Speculative decoding through ``ferry serve --speculative-algorithm NGRAM`` (issue 41
item 3): a seeded sampled request gives the same text alone (its steps verify NGRAM drafts)
and beside a dozen other requests (past ``--speculative-max-batch-size``, so its steps
decode one token), and the same as a server without speculation: the draw for output
position i is a function of (seed, i) and the logits, and a verify row accepts a draft
exactly when it is the token a decode step draws there (``engine/sampling/acceptance.py``).
"""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest
from api_helpers import comp

pytestmark = pytest.mark.slow

SERVER_ARGS = ["--max-total-tokens", "16384", "--speculative-algorithm", "NGRAM",
               "--speculative-num-draft-tokens", "2", "--speculative-max-batch-size", "4"]

PARAGRAPH = ("The river rises in the hills north of the town, runs south through the old "
             "mill and the market square, and joins the sea at the harbour.")
PROMPT = f"Repeat this paragraph word for word.\n\n{PARAGRAPH}\n\nRepeated:\n"
KW = {"max_tokens": 32, "temperature": 0.8, "seed": 1234, "ignore_eos": True}


def _verify_steps(url: str) -> int:
    info = httpx.get(url + "/server_info", timeout=30).json()
    return int(info.get("stats", {}).get("spec_verify_steps", 0))


def test_seeded_text_is_the_same_alone_beside_others_and_without_speculation(server,
                                                                              shared_server):
    url = server.url
    before = _verify_steps(url)
    alone = comp(url, PROMPT, **KW)["choices"][0]["text"]
    assert _verify_steps(url) > before  # the request alone speculated
    assert comp(url, PROMPT, **KW)["choices"][0]["text"] == alone
    with cf.ThreadPoolExecutor(13) as ex:
        # long unseeded requests first, so the seeded one decodes beside a dozen others
        others = [ex.submit(comp, url, f"Write a long story about dragon number {i}.",
                            max_tokens=48, temperature=1.0, ignore_eos=True)
                  for i in range(12)]
        mine = ex.submit(comp, url, PROMPT, **KW)
        busy = mine.result()["choices"][0]["text"]
        for f in others:
            f.result()
    assert busy == alone
    # a server without speculation: the same draws at the same positions
    assert comp(shared_server.url, PROMPT, **KW)["choices"][0]["text"] == alone
