"""The op-level selective recompute policy's split of a layer's matmuls, and what a
layer keeps under it (costmodel.terms.recompute, costmodel.terms.memory)."""

from __future__ import annotations

import pytest

from costmodel.specs.loading import load_cluster, load_model, make_training
from costmodel.terms.memory import layer_activation_bytes, op_level_activation_bytes
from costmodel.terms.recompute import layer_matmuls, op_level_split


def names(matmuls):
    return [m.name for m in matmuls]


def test_llama_keeps_q_v_gate_down_and_repeats_k_o_up():
    kept, repeated = op_level_split(load_model("llama3-8b"), tp=1)
    assert names(kept) == ["q", "v", "gate", "down"] and names(repeated) == ["k", "o", "up"]


def test_a_biased_linear_is_addmm_which_the_policy_neither_keeps_nor_counts():
    # GPT: every projection has a bias, so no aten.mm is counted and nothing is kept.
    model = load_model("gpt3-1.3b")
    kept, repeated = op_level_split(model, tp=1)
    assert kept == () and names(repeated) == ["q", "k", "v", "o", "up", "down"]


def test_row_parallel_outputs_are_whole_under_tp():
    # o and down write partial sums of the whole hidden width before the reduction.
    widths = {m.name: m.out_width for m in layer_matmuls(load_model("llama3-8b"), tp=8)}
    assert widths == {"q": 4096 / 8, "k": 1024 / 8, "v": 1024 / 8, "o": 4096,
                      "gate": 14336 / 8, "up": 14336 / 8, "down": 4096}


def test_the_shared_expert_and_its_gate_follow_the_routed_experts():
    matmuls = layer_matmuls(load_model("tiny-moe-shared"), tp=1, ep=2)
    widths = [(m.name, m.out_width, m.tokens_fraction) for m in matmuls]
    assert widths[4] == ("router", 8, 1.0)
    assert len(widths) == 4 + 1 + 4 * 3 + 4
    assert widths[-4:] == [("gate", 128, 1.0), ("up", 128, 1.0), ("down", 64, 1.0), ("shared_gate", 1, 1.0)]


@pytest.mark.parametrize("ep", [1, 2, 8])
def test_routed_experts_grouped_gemms_are_neither_kept_nor_counted(ep):
    """The routed experts run as torch._grouped_mm (or bmm), not aten.mm: the policy
    recomputes them and counts on past them, whatever the rank's number of experts."""
    kept, repeated = op_level_split(load_model("tiny-moe-shared"), tp=1, ep=ep)
    assert names(kept) == ["q", "v", "router", "up", "shared_gate"]
    assert names(repeated) == ["k", "o"] + ["gate", "up", "down"] * (8 // ep) + ["gate", "down"]


@pytest.mark.parametrize("mixed, residual", [("param_dtype", 2), ("autocast", 4)])
def test_op_level_bytes_by_hand(mixed, residual):
    # Llama 3 8B, micro-batch 2, seq 8192: the layer input, q (4096), v (1024), gate
    # (14336) and down (4096) in bf16, SDPA's output (4096 bf16) and log-sum-exp (32 fp32).
    model = load_model("llama3-8b")
    cluster = load_cluster("dgx-h100", gpus=8)
    training = make_training(model, cluster, 16, 8192, "bf16", "adamw", True, mixed)
    per_token = residual * 4096 + 2 * (4096 + 1024 + 14336 + 4096) + 2 * 4096 + 4 * 32
    assert op_level_activation_bytes(model, training, 2, 1, False) == 2 * 8192 * per_token
    assert layer_activation_bytes(model, training, 2, 1, False, "selective", "op-level") == 2 * 8192 * per_token


def test_op_level_under_sequence_parallelism_keeps_the_reduce_scatter_outputs():
    model = load_model("llama3-8b")
    cluster = load_cluster("dgx-h100", gpus=8)
    training = make_training(model, cluster, 8, 4096, "bf16", "adamw", True, "param_dtype")
    tokens, tp = 4096, 8
    per_token = (2 * 4096 / tp                                  # the input, split by SP
                 + 2 * (4096 / tp + 1024 / tp + 14336 / tp + 4096)   # q, v, gate, down (whole)
                 + (2 * 4096 + 4 * 32) / tp                       # SDPA's output and log-sum-exp
                 + 2 * 2 * 4096 / tp)                             # two reduce-scatter outputs
    assert op_level_activation_bytes(model, training, 1, tp, True) == pytest.approx(tokens * per_token, rel=1e-12)
