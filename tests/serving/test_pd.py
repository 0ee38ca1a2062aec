"""Real vLLM engines serve tokens as a P/D pair, in vLLM's toy-proxy flow (docs/serving.md).

Each case starts P and D as OpenAI API server processes (``tests/serving/_servers.py``), each on its own
core. Per prompt: P completes it with ``max_tokens=1`` and ``kv_transfer_params: {"do_remote_decode":
true}``; D completes it with the ``kv_transfer_params`` P returned, pulling P's KV cache (and SSM state)
over NIXL instead of computing the prompt. D's greedy fp32 token ids must equal those of one engine
computing the prompt alone (D itself, before any transfer, without ``kv_transfer_params``; the first pair
of a model fixes the reference and every later D must agree with it), D's ``/metrics`` must show bytes moved
and no failed transfer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _models import PROMPTS
from _servers import RESULTS, Server, wait_metric

MAX_TOKENS = 12
BYTES = "vllm:nixl_bytes_transferred_sum"
FAILED = "vllm:nixl_num_failed_transfers_total"


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    connector: str  # "NixlConnector" or "KvgeomNixlConnector"
    mode: str  # "stock" for vLLM's connector, else kvgeom_vllm's compat mode
    p_block: int = 32
    d_block: int = 32

    def kv_transfer_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "kv_connector": self.connector,
            "kv_role": "kv_both",
            "kv_buffer_device": "cpu",
        }
        if self.connector != "NixlConnector":
            cfg["kv_connector_module_path"] = "kvgeom_vllm"
            cfg["kv_connector_extra_config"] = {"compat": self.mode}
        return cfg


KVGEOM = "KvgeomNixlConnector"
CASES = [
    Case("dense 32->32", "dense", "NixlConnector", "stock"),
    Case("nemotron_h 32->32", "nemotron_h", "NixlConnector", "stock"),
    Case("dense 32->32 kvgeom_vllm", "dense", KVGEOM, "vllm"),
    Case("nemotron_h 32->32 kvgeom_vllm", "nemotron_h", KVGEOM, "vllm"),
    Case("dense 32->32 kvgeom mode", "dense", KVGEOM, "kvgeom"),
    Case("nemotron_h 32->32 kvgeom mode", "nemotron_h", KVGEOM, "kvgeom"),
]


def start_pair(case: Case, model: Path, logs: Path) -> tuple[Server, Server]:
    tag = case.name.replace(" ", "_").replace(">", "").replace("-", "_")
    cfg = case.kv_transfer_config()
    p = Server(f"P[{case.name}]", model, logs / f"{tag}.P.log", core=0, block_size=case.p_block,
               kv_transfer_config=cfg)  # fmt: skip
    d = Server(f"D[{case.name}]", model, logs / f"{tag}.D.log", core=1, block_size=case.d_block,
               kv_transfer_config=cfg)  # fmt: skip
    try:
        p.start()
        d.start()
        p.wait_ready()
        d.wait_ready()
    except BaseException:
        p.stop()
        d.stop()
        raise
    return p, d


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_pd_pair_serves_the_single_engine_tokens(
    case: Case, model_dirs: dict[str, Path], logs_dir: Path, references: dict[str, dict[str, list[int]]]
) -> None:
    t0 = time.monotonic()
    p, d = start_pair(case, model_dirs[case.model], logs_dir)
    try:
        # one engine computing each prompt alone: D before any transfer
        own = {prompt: d.complete(prompt, MAX_TOKENS)["token_ids"] for prompt in PROMPTS}
        assert all(len(t) == MAX_TOKENS for t in own.values()), own
        ref = references.setdefault(case.model, own)
        assert own == ref, f"{case.name}: D's own completions differ from the model's reference"
        before = d.metrics()
        equal = 0
        mismatches = []
        for prompt in PROMPTS:
            first = p.complete(prompt, 1, {"do_remote_decode": True})
            params = first["kv_transfer_params"]
            assert params and params.get("remote_engine_id"), f"P returned no kv_transfer_params: {first}"
            got = d.complete(prompt, MAX_TOKENS, params)["token_ids"]
            if got == ref[prompt]:
                equal += 1
            else:
                mismatches.append((prompt[:30], got, ref[prompt]))
        moved = wait_metric(d, BYTES, lambda v: v > before.get(BYTES, 0.0)) - before.get(BYTES, 0.0)
        failed = d.metrics().get(FAILED, 0.0) - before.get(FAILED, 0.0)
    finally:
        p.stop()
        d.stop()
    RESULTS.append(
        {
            "case": case.name, "connector": case.connector, "mode": case.mode, "prompts": len(PROMPTS),
            "equal": equal, "bytes": int(moved), "failed": int(failed), "time_s": time.monotonic() - t0,
        }
    )  # fmt: skip
    assert moved > 0, f"{case.name}: D's /metrics shows no bytes transferred"
    assert failed == 0, f"{case.name}: {failed} failed transfers"
    assert equal == len(PROMPTS), f"{case.name}: {equal} of {len(PROMPTS)} equal; {mismatches}"
