"""``intake.body._request`` builds a GenerationRequest positionally (per request, cheaper than a
23-field keyword call): every argument lands in the field it names, and no field is left out."""

from __future__ import annotations

from dataclasses import fields

from sidecar.intake.body import GenerationRequest, _Prompt, _request


def test_each_argument_lands_in_its_field() -> None:
    common = {
        "path": "/p",
        "kind": "k",
        "stream": "stream",
        "priority": "priority",
        "declared_prompt_tokens": "declared",
        "prefix_key": "prefix",
        "declared_cached_tokens": "cached",
        "body_obj": {"body": 1},
    }
    prompt = _Prompt(text="text", token_ids=[7], batch_texts=("b",), batch_token_ids=([8],), n_texts=9)
    req = _request(common, "max", "rid", ("r",), "model", prompt, ["m"], ["t"], "embeds", "n", "lp", "media")
    expected = {
        "path": "/p",
        "kind": "k",
        "stream": "stream",
        "max_new_tokens": "max",
        "priority": "priority",
        "rid": "rid",
        "rids": ("r",),
        "model": "model",
        "prompt_text": "text",
        "prompt_token_ids": [7],
        "messages": ["m"],
        "tools": ["t"],
        "batch_texts": ("b",),
        "batch_token_ids": ([8],),
        "input_embeds_tokens": "embeds",
        "n_texts": 9,
        "parallel_samples": "n",
        "logprob_start": "lp",
        "media_items": "media",
        "declared_prompt_tokens": "declared",
        "prefix_key": "prefix",
        "declared_cached_tokens": "cached",
        "body_obj": {"body": 1},
    }
    assert [f.name for f in fields(GenerationRequest)] == list(expected)  # a new field fails here
    assert {name: getattr(req, name) for name in expected} == expected
