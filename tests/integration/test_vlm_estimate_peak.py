"""The estimated peak memory of a generative VLM's answer trace against the peak measured in a fresh process (the
resident high-water mark of the trace alone, reset just before it: ``/proc/self/clear_refs``), on a tiny LLaVA with
a long prompt, where the pass's memory is the LM's whole-sequence attention and its gradients (the stored Dataset
is under 1 MB whatever the prompt's length)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]

_PROBE = r"""
import gc, json, sys, torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
import vitcam_nb as vc

n_text, dtype = int(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)
v = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=32,
                     patch_size=8)
t = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=64, max_position_embeddings=4096)
m = LlavaForConditionalGeneration(LlavaConfig(vision_config=v, text_config=t, image_token_id=63,
                                              vision_feature_layer=-2)).eval()
x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
target = vc.targets.answer(input_ids=[1] + [63] * 16 + [5 + i % 50 for i in range(n_text)], answer_ids=[9, 10, 11])
vc.trace(m, x, targets=target, dtype=dtype)  # lazy imports and first-call allocations, not measured
gc.collect()

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
tr = vc.trace(m, x, targets=target, dtype=dtype)
rise = status("VmHWM") - before
est = vc.estimate(m, x, targets=target, dtype=dtype)
print(json.dumps({"rise": rise, "peak": est["peak_bytes"], "dataset": est["dataset_bytes"], "nbytes": tr.nbytes}))
"""


def _clear_refs_works() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _clear_refs_works(), reason="needs Linux's /proc/self/clear_refs to measure one call's peak")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_estimated_peak_is_within_a_third_above_the_measured_one(dtype):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _PROBE, "900", dtype], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["dataset"] == pytest.approx(got["nbytes"], rel=0.005)
    assert got["rise"] > 100 * got["dataset"]  # the pass, not the Dataset, is what is measured here
    # Measured at 620 and 1,220 prompt tokens: the estimate 4-15 % above the peak; never below it by more than 5 %.
    assert 0.95 * got["rise"] <= got["peak"] <= 1.33 * got["rise"], got
