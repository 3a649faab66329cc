"""The executor's models against the cost model's view of the same spec: parameter
counts exactly, forward FLOPs exactly, backward twice the forward; and context-parallel
attention against plain causal attention on the whole sequence."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from costmodel_test_helpers import HF_DIR
from torch.utils.flop_counter import FlopCounterMode

from costmodel.specs.loading import load_model
from costmodel.terms.counts import (
    head_forward_flops,
    layer_forward_flops,
    total_parameters,
)
from costmodel.trace import EXTRA_FLOP_FORMULAS
from executor.data import context_positions
from executor.launch import run_local
from executor.models import (
    ContextShard,
    LatentAttention,
    MoE,
    attention_core,
    causal_attention,
    build_model,
    initial_value,
    materialize,
    num_parameters,
    rope_tables,
)

# The tiny built-ins and every built-in family shrunk to a few small layers (the
# counts are formulas in the sizes, so small sizes test the same code paths).
# Published Hugging Face configs of the dense decoder families the spec describes: head_dim
# apart from hidden / heads, q/k/v biases, q/k norm, GeGLU, parallel blocks with one or
# two norms, LM-head bias, tied and untied heads.
HF_SPECS = [str(HF_DIR / n) for n in ("qwen2.5-1.5b.json", "qwen3-1.7b.json", "gemma-2b.json", "phi-2.json",
                                       "pythia-1.4b.json", "llama-3.2-1b.json")]
SPECS = ["tiny-gpt", "tiny-llama", "tiny-moe", "tiny-moe-shared", "tiny-qwen3-moe", "tiny-deepseek", "tiny-dense", "gpt3-1.3b", "llama2-7b", "llama3-8b",
         "mixtral-8x7b", "qwen1.5-moe-a2.7b", *HF_SPECS]


def small(name):
    spec = load_model(name)
    if spec.name.startswith("tiny"):
        return spec
    heads, kv = spec.num_attention_heads, spec.num_key_value_heads
    shrink = 8
    explicit = spec.head_dim != spec.hidden_size // heads
    return dataclasses.replace(
        spec, hidden_size=spec.hidden_size // shrink // heads * heads or heads, num_hidden_layers=2,
        intermediate_size=spec.intermediate_size // shrink, vocab_size=spec.vocab_size // shrink,
        max_position_embeddings=128, num_key_value_heads=kv,
        head_dim=spec.head_dim // shrink if explicit else None)


@pytest.mark.parametrize("name", SPECS)
def test_parameter_count_equals_cost_model(name):
    spec = small(name)
    model = build_model(spec)
    assert num_parameters(model) == total_parameters(spec)


@pytest.mark.parametrize("name", SPECS)
def test_flops_equal_cost_model(name):
    spec = small(name)
    seq, batch = 32, 2
    model = build_model(spec, seq_len=seq, device="cpu")   # MoE routing has no meta kernels
    for layer in model.layers.values():
        layer.attention.flash = False   # count the score matrix as the cost model does
    tokens = torch.randint(0, spec.vocab_size, (batch, seq), device="cpu")
    with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as forward:
        logits = model(tokens)
    # A model with dense-MLP layers among its expert ones: each kind at its own count.
    dense, sparse = len(spec.mlp_only_layers), spec.num_hidden_layers - len(spec.mlp_only_layers)
    layers = sparse * layer_forward_flops(spec, seq) + (dense and dense * layer_forward_flops(spec.dense_layer(), seq))
    expected = batch * (layers + head_forward_flops(spec, seq))
    assert forward.get_total_flops() == expected
    with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as backward:
        logits.sum().backward()
    assert backward.get_total_flops() == 2 * expected


def test_materialize_is_deterministic_and_tied():
    spec = load_model("tiny-gpt")
    a = materialize(build_model(spec), "cpu", seed=3)
    b = materialize(build_model(spec), "cpu", seed=3)
    c = materialize(build_model(spec), "cpu", seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.tok_embeddings.weight, c.tok_embeddings.weight)
    assert a.output.weight is a.tok_embeddings.weight
    assert torch.equal(a.layers["0"].attention_norm.weight, torch.ones(spec.hidden_size))
    assert float(a.layers["1"].attention.wq.weight.std()) == pytest.approx(0.02, rel=0.1)
    untied = build_model(spec)
    untied.untie()
    materialize(untied, "cpu", seed=3)
    assert torch.equal(untied.output.weight, a.tok_embeddings.weight)
    assert torch.equal(initial_value("layers.0.attention.wq.bias", (4,), 0, False), torch.zeros(4))


@pytest.mark.parametrize("name", [str(HF_DIR / "gemma-2b.json"), str(HF_DIR / "qwen3-1.7b.json")])
def test_head_dim_apart_from_hidden_over_heads(name):
    """Gemma 7B's 16 heads of 256 on hidden 3072: Q and output projections are heads x
    head_dim wide; counts and FLOPs still equal the cost model's."""
    spec = dataclasses.replace(small(name), head_dim=48)
    assert spec.q_size != spec.hidden_size
    model = build_model(spec, seq_len=16, device="cpu")
    assert num_parameters(model) == total_parameters(spec)
    for layer in model.layers.values():
        layer.attention.flash = False
    tokens = torch.randint(0, spec.vocab_size, (1, 16))
    with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as forward:
        model(tokens)
    assert forward.get_total_flops() == spec.num_hidden_layers * layer_forward_flops(spec, 16) + head_forward_flops(spec, 16)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_chunked_cross_entropy_equals_the_plain_loss(dtype, monkeypatch):
    """ChunkedCrossEntropy over chunks of 16 tokens: the value and the gradient of
    F.cross_entropy (over the logits upcast to fp32 for bf16, as autocast runs it), and
    the logits untouched."""
    import executor.models as models
    monkeypatch.setattr(models, "LOSS_CHUNK_BYTES", 4 * 97 * 16)
    torch.manual_seed(0)
    logits = (torch.randn(3, 50, 97, dtype=torch.float64) * 3).to(dtype)
    targets = torch.randint(0, 97, (3, 50))
    mine, plain = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = models.cross_entropy(mine, targets)
    loss.backward()
    reference = F.cross_entropy(plain.flatten(0, 1).to(torch.promote_types(dtype, torch.float32)), targets.flatten())
    reference.backward()
    assert loss.dtype == reference.dtype
    tolerance = 1e-14 if dtype == torch.float64 else 1e-6
    assert loss.item() == pytest.approx(reference.item(), rel=tolerance)
    if dtype == torch.bfloat16:
        assert torch.equal(mine.grad, plain.grad)
    else:
        assert torch.allclose(mine.grad, plain.grad, rtol=0, atol=1e-16)

    assert torch.equal(mine.detach(), logits)



def per_expert_loop(moe, x, counts):
    """The loop the experts' one-call paths replace: each expert's SwiGLU on its rows."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        rows = x[start:start + n]
        outs.append((F.silu(rows @ moe.w1[e].t()) * (rows @ moe.w3[e].t())) @ moe.w2[e].t())
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("dtype, grouped", [(torch.float32, True), (torch.float64, False)])
def test_experts_in_one_call_equal_the_per_expert_loop(dtype, grouped):
    """fp32 takes torch._grouped_mm, fp64 the padded batched matmul; both give the loop's
    output and gradients, an expert without rows included: exactly, except the padded
    path's weight gradients, which the batched matmul sums in its BLAS's order (bitwise
    on one machine, 1 ulp apart on an AVX2 AMD EPYC)."""
    from executor.models import MoE, _grouped_mm_fits
    torch.manual_seed(0)
    moe = MoE(load_model("tiny-moe")).to(dtype)
    for w in (moe.w1, moe.w3, moe.w2):
        torch.nn.init.normal_(w, std=0.05)
    counts = [5, 0, 7, 4]
    x = torch.randn(16, 64, dtype=dtype, requires_grad=True)
    upstream = torch.randn(16, 64, dtype=dtype)
    assert _grouped_mm_fits(x, moe.w1, moe.w2) == grouped
    moe.experts(x, counts).backward(upstream)
    mine = [x.grad.clone()] + [w.grad.clone() for w in (moe.w1, moe.w3, moe.w2)]
    x.grad = None
    moe.zero_grad()
    out = per_expert_loop(moe, x, counts)
    out.backward(upstream)
    assert torch.equal(moe.experts(x, counts), out)
    assert torch.equal(mine[0], x.grad)
    for a, b in zip(mine[1:], [w.grad for w in (moe.w1, moe.w3, moe.w2)]):
        ulps = 0 if grouped else 4
        torch.testing.assert_close(a, b, rtol=0, atol=ulps * torch.finfo(dtype).eps * b.abs().max().item())


def routed_per_token(moe, x, capacity):
    """The MoE output token by token: each token's k experts weighted by the softmax of
    their router logits, a choice counted only while its expert has room (capacity rows,
    earliest tokens first); None is dropless."""
    logits, chosen = moe.router(x).topk(moe.top_k, dim=-1)
    weights = logits.softmax(-1)
    taken = [0] * moe.num_experts
    out, dropped = torch.zeros_like(x), 0
    for t in range(x.shape[0]):
        for j in range(moe.top_k):
            e = int(chosen[t, j])
            if capacity is not None and taken[e] >= capacity:
                dropped += 1
                continue
            taken[e] += 1
            hidden = F.silu(x[t] @ moe.w1[e].t()) * (x[t] @ moe.w3[e].t())
            out[t] += weights[t, j] * (hidden @ moe.w2[e].t())
    return out, dropped


@pytest.mark.parametrize("capacity_factor, capacity, expect_drops", [(None, None, False), (0.5, 8, True),
                                                                     (1.0, 16, True), (4.0, 64, False)])
def test_capacity_keeps_each_experts_earliest_rows(capacity_factor, capacity, expect_drops):
    """32 tokens, top-2 of 4 experts: capacity ceil(c x 32 x 2 / 4) rows per expert. The
    layer equals the token-by-token reference in float64, value and gradient; c = 0.5
    and 1 drop rows under this routing, c = 4 and dropless none."""
    from executor.models import MoE
    torch.manual_seed(0)
    spec = dataclasses.replace(load_model("tiny-moe"), moe_capacity_factor=capacity_factor)
    moe = MoE(spec).to(torch.float64)
    for w in (moe.router.weight, moe.w1, moe.w3, moe.w2):
        torch.nn.init.normal_(w, std=0.2)
    x = torch.randn(32, 64, dtype=torch.float64, requires_grad=True)
    assert (spec.num_local_experts, spec.num_experts_per_tok) == (4, 2)
    mine = moe(x)
    mine.square().sum().backward()
    grads = [x.grad.clone(), moe.router.weight.grad.clone(), moe.w1.grad.clone()]
    x.grad = None
    moe.zero_grad()
    reference, dropped = routed_per_token(moe, x, capacity)
    reference.square().sum().backward()
    assert (dropped > 0) == expect_drops
    torch.testing.assert_close(mine, reference, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, [x.grad, moe.router.weight.grad, moe.w1.grad]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def whole_attention(heads=4, kv_heads=2, seq_len=16, head_dim=8):
    """Seeded q, k, v of two sequences (grouped-query: fewer kv heads) and the gradient
    of the output, float64, the same on every rank."""
    generator = torch.Generator().manual_seed(5)
    q, grad = (torch.randn(2, heads, seq_len, head_dim, generator=generator, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, kv_heads, seq_len, head_dim, generator=generator, dtype=torch.float64) for _ in range(2))
    return q, k, v, grad


def context_attention_rank(rank, world, flash):
    """This cp rank's output and input gradients: its two chunks of queries against the
    keys and values gathered over the ranks."""
    import torch.distributed as dist

    q, k, v, grad = whole_attention()
    shard = ContextShard(rank, world, dist.group.WORLD)
    positions = context_positions(q.shape[2], rank, world)
    local = [t[:, :, positions].clone().requires_grad_() for t in (q, k, v)]
    out = attention_core(local[0], *shard.gather(local[1], local[2]), flash, shard)
    out.backward(grad[:, :, positions])
    return {"positions": positions, "out": out.detach(), "grads": [t.grad for t in local]}


def test_causal_attention_of_the_last_queries_is_the_square_causal_attention_cut():
    """Queries that are the last T_q of T_k positions (causal at the bottom-right, as each
    context-parallel chunk attends) equal those rows of causal attention over all T_k,
    fused and materialised."""
    q, k, v, _ = whole_attention(kv_heads=4)
    for flash in (True, False):
        whole = attention_core(q, k, v, flash)
        torch.testing.assert_close(causal_attention(q[:, :, 10:], k, v, flash), whole[:, :, 10:], rtol=0, atol=1e-13)


@pytest.mark.parametrize("flash", [True, False])
def test_context_parallel_attention_is_causal_attention_on_the_whole_sequence(flash):
    """Two cp ranks: the output at each rank's positions, and the gradients of its q, k and
    v (the keys' and values' summed over the ranks' queries by the all-gather's
    reduce-scatter), equal one process's causal attention over the whole sequence, to
    float64 rounding."""
    q, k, v, grad = whole_attention()
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention_core(*whole, flash)
    out.backward(grad)
    for rank in run_local(context_attention_rank, 2, flash):
        at = rank["positions"]
        torch.testing.assert_close(rank["out"], out.detach()[:, :, at], rtol=0, atol=1e-13)
        for mine, reference in zip(rank["grads"], whole):
            torch.testing.assert_close(mine, reference.grad[:, :, at], rtol=0, atol=1e-13)


def context_saved_bytes_rank(rank, world, seq_len):
    """What autograd saves for one of the executor's layers on this cp rank (2 layers
    less 1, bf16 autocast, parameters left out), its tokens those executor.data gives it."""
    from torch.distributed.device_mesh import init_device_mesh

    from executor.parallelize import apply_context_parallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))

    def saved(layers: int) -> int:
        spec = load_model("tiny-llama", {"num_hidden_layers": str(layers)})
        model = materialize(build_model(spec, seq_len), "cpu", 0)
        apply_context_parallel(model, mesh["cp"])
        own = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
        seen: dict[int, int] = {}

        def pack(t):
            seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            return t
        tokens = torch.randint(0, spec.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
        local = tokens[:, context_positions(seq_len, rank, world)]
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(local)
        return sum(n for k, n in seen.items() if k not in own)
    return saved(2) - saved(1)


def test_a_context_parallel_layer_saves_what_the_cost_model_counts():
    """cp 2, bf16 autocast: one layer keeps its s/cp tokens' tensors and K and V of the
    whole sequence, repeated to every query head (costmodel.terms.memory, with the gathers'
    index), and on CPU what CUDA does not make: the head-major SDPA output copy, and the
    lower-right causal mask of each chunk that is not the first (CPU's SDPA makes it, in
    bf16; CUDA's fused kernels take the causal bias as it is)."""
    from costmodel.specs.loading import load_cluster, make_training
    from costmodel.terms.memory import pytorch_layer_activation_bytes

    seq_len, cp = 64, 2
    spec = load_model("tiny-llama")
    training = make_training(spec, load_cluster("dgx-h100", gpus=1), 1, seq_len, precision="bf16",
                             mixed_precision="autocast")
    counted = pytorch_layer_activation_bytes(spec, training, 1, 1, False, "none", cp=cp)
    chunk = seq_len // (2 * cp)
    cpu_output_copy = 2 * spec.q_size * seq_len // cp
    for rank, measured in enumerate(run_local(context_saved_bytes_rank, cp, seq_len)):
        cpu_masks = sum(2 * chunk * (g + 1) * chunk for g in (rank, 2 * cp - 1 - rank) if g > 0)
        assert measured == counted + cpu_output_copy + cpu_masks


def test_latent_attention_and_sigmoid_group_routing_equal_transformers():
    """The built DeepSeek-V3 pieces against transformers' own (5.x modeling_deepseek_v3):
    multi-head latent attention with the same weights gives the same output (RoPE on
    interleaved pairs, transformers' rope_interleave layout), and the router picks the
    same experts with the same weights (sigmoid scores, the best 2 of 4 groups, normalised,
    times 2.5). transformers' RMSNorm and router run in float32: agreement to 1e-6."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    torch.manual_seed(0)
    spec = load_model("tiny-deepseek")
    config = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                              kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                              rope_interleave=True, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                              routed_scaling_factor=2.5, norm_topk_prob=True)
    config._attn_implementation = "sdpa"
    theirs, ours = hf.DeepseekV3Attention(config, 0).double(), LatentAttention(spec).double()
    ours.q_norm.eps = ours.kv_norm.eps = theirs.q_a_layernorm.variance_epsilon
    names = {"q_a_proj": "wq_a", "q_a_layernorm": "q_norm", "q_b_proj": "wq_b", "kv_a_proj_with_mqa": "wkv_a",
             "kv_a_layernorm": "kv_norm", "kv_b_proj": "wkv_b", "o_proj": "wo"}
    with torch.no_grad():
        for their_name, our_name in names.items():
            for leaf, weight in getattr(theirs, their_name).named_parameters():
                norm = "norm" in their_name
                weight.copy_(torch.randn_like(weight) * (0.1 if norm else 0.3) + (1.0 if norm else 0.0))
                getattr(getattr(ours, our_name), leaf).copy_(weight)
    x = torch.randn(2, 12, 64, dtype=torch.float64)
    cos, sin = rope_tables(12, spec.qk_rope_head_dim, dtype=torch.float64)
    expected = theirs(x, (torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]), None)[0]
    assert torch.allclose(ours(x, cos, sin), expected, rtol=0, atol=1e-5 * float(expected.abs().max()))

    router, moe = hf.DeepseekV3TopkRouter(config).double(), MoE(spec).double()
    with torch.no_grad():
        router.weight.copy_(torch.randn_like(router.weight))
        moe.router.weight.copy_(router.weight)
    tokens = torch.randn(64, 64, dtype=torch.float64)
    _, their_weights, their_experts = router(tokens)
    our_weights, our_experts = moe._sigmoid_route(moe.router(tokens))
    theirs_sorted, ours_sorted = their_experts.sort(-1), our_experts.sort(-1)
    assert torch.equal(theirs_sorted.values, ours_sorted.values)
    assert torch.allclose(our_weights.gather(1, ours_sorted.indices),
                          their_weights.gather(1, theirs_sorted.indices).to(our_weights.dtype), rtol=1e-6, atol=0)
