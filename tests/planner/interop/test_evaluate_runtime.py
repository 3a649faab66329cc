"""`evaluate` prices each engine's configuration under that engine's runtime profile,
with what the configuration says of its runtime (torchtitan: compile, async TP, per-op SAC)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.estimate import estimate
from costmodel.specs.loading import load_model, load_runtime
from planner.api import make_problem
from planner.interop.evaluate import ENGINE_RUNTIMES, evaluate_config
from planner.interop.torchtitan import read_torchtitan
from planner.rules import load_rules

TOML = """
[parallelism]
data_parallel_shard_degree = 8
tensor_parallel_degree = 1
enable_async_tensor_parallel = true
[training]
local_batch_size = 2
global_batch_size = 16
seq_len = 4096
[compile]
enable = true
[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"
"""


def test_each_engine_has_its_runtime():
    assert ENGINE_RUNTIMES == {"megatron": "megatron", "deepspeed": "deepspeed-zero", "torchtitan": "pytorch-native"}


def test_a_torchtitan_toml_states_compile_async_tp_and_per_op_sac():
    imported = read_torchtitan(TOML, load_model("llama2-7b"), 8, toml=True)
    assert dict(imported.runtime_settings) == {"torch_compile": True, "async_tp": True,
                                               "selective_recompute": "op-level", "chunked_loss": False,
                                               "fsdp_kept_gathered": "head"}
    # Resharding every unit after forward keeps none gathered; so does DDP.
    always = TOML.replace("[parallelism]", '[parallelism]\nfsdp_reshard_after_forward = "always"')
    assert dict(read_torchtitan(always, load_model("llama2-7b"), 8, toml=True).runtime_settings)[
        "fsdp_kept_gathered"] == "none"


def test_evaluate_prices_a_torchtitan_toml_under_pytorch_native_with_its_settings(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(TOML)
    ev = evaluate_config("torchtitan", str(path), "llama2-7b", "dgx-a100-80gb", gpus=8, rules=load_rules(None))
    expected = replace(load_runtime("pytorch-native"), torch_compile=True, async_tp=True,
                       selective_recompute="op-level", chunked_loss=False, fsdp_kept_gathered="head")
    assert ev.problem.runtime == expected
    problem = make_problem("llama2-7b", "dgx-a100-80gb", 16, gpus=8, seq_len=4096, runtime=expected)
    assert ev.yours.step_time_s == pytest.approx(estimate(problem, ev.strategy).step_time_s, rel=1e-12)
