"""Traced layer graphs: the built-in families traced on the meta device equal their
analytic graphs; DAG models (skip connections, encoder-decoder) trace into graphs whose
edges follow the data; a 70B model traces on the meta device without memory (its time
is bench/trace_time.py's)."""

import resource

import networkx as nx
import pytest
import torch
from torch import nn

from costmodel.specs.loading import load_model
from costmodel.terms.counts import build_graph
from costmodel.trace import repeats, split_role, trace_module
from executor.models import build_model

SEQ = 32


def traced(name, seq=SEQ):
    spec = load_model(name)
    # MoE routing depends on the values (which expert each token picks): real tensors.
    device = "cpu" if spec.is_moe else "meta"
    model = build_model(spec, seq, device=device)
    for layer in model.layers.values():
        layer.attention.flash = False   # count the score matrix, as the analytic graph does
    tokens = torch.randint(0, spec.vocab_size, (2, seq), device=device)
    return spec, trace_module(model, (tokens,))


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama", "tiny-moe"])
def test_traced_graph_equals_the_analytic_graph(name):
    spec, graph = traced(name)
    analytic = build_graph(spec, SEQ)
    order = graph.graph["order"]
    layers = [n for n in order if n.startswith("layers.")]
    first, last = order.index(layers[0]), order.index(layers[-1])
    before = sum(graph.nodes[n]["parameters"] for n in order[:first]) + graph.graph["glue_parameters"]
    after = sum(graph.nodes[n]["parameters"] for n in order[last + 1:])
    assert before == analytic.nodes["embedding"]["parameters"]
    assert after == analytic.nodes["head"]["parameters"]
    for i, node in enumerate(layers):
        assert graph.nodes[node]["parameters"] == analytic.nodes[f"layer.{i}"]["parameters"]
        # Two sequences in the batch; the analytic graph counts one.
        assert graph.nodes[node]["forward_flops"] == pytest.approx(2 * analytic.nodes[f"layer.{i}"]["forward_flops"], rel=0.01)
        assert graph.nodes[node]["backward_flops"] == 2 * graph.nodes[node]["forward_flops"]
    head_flops = sum(graph.nodes[n]["forward_flops"] for n in order[last + 1:])
    assert head_flops == pytest.approx(2 * analytic.nodes["head"]["forward_flops"], rel=0.01)
    # A chain, in execution order; the layers are one repeated block.
    assert list(nx.topological_sort(graph)) == order
    assert [len(v) for k, v in repeats(graph).items() if k[0] == "Block"] == [spec.num_hidden_layers]
    # What a layer hands on is one b x s x h activation (fp32 on meta).
    assert graph.nodes["layers.0"]["output_bytes"] == 4 * 2 * SEQ * spec.hidden_size
    assert graph.nodes["layers.0"]["saved_bytes"] > graph.nodes["layers.0"]["output_bytes"]


def test_linear_roles_follow_megatron_names():
    _, graph = traced("tiny-llama")
    roles = graph.nodes["layers.0"]["linears"]
    assert roles["attention.wq"] == roles["attention.wk"] == roles["feed_forward.w1"] == "column"
    assert roles["attention.wo"] == roles["feed_forward.w2"] == "row"
    assert split_role("self_attn.q_proj") == "column" and split_role("mlp.down_proj") == "row"
    assert split_role("transformer.h.0.attn.c_attn") == "column" and split_role("lm_head") is None


class UNet(nn.Module):
    """Two encoder levels, a bottleneck, two decoder levels fed by skip connections."""

    def __init__(self, c=8):
        super().__init__()
        conv = lambda i, o: nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.ReLU())  # noqa: E731
        self.enc = nn.ModuleList([Level(conv(3, c)), Level(conv(c, 2 * c))])
        self.bottleneck = conv(2 * c, 2 * c)
        self.dec = nn.ModuleList([Up(4 * c, c), Up(2 * c, c)])
        self.head = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        skips = []
        for level in self.enc:
            x = level(x)
            skips.append(x)
            x = nn.functional.max_pool2d(x, 2)
        x = self.bottleneck(x)
        for up, skip in zip(self.dec, reversed(skips)):
            x = up(x, skip)
        return self.head(x)


class Level(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return self.block(x)


class Up(nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.conv = nn.Conv2d(i, o, 3, padding=1)

    def forward(self, x, skip):
        x = nn.functional.interpolate(x, scale_factor=2)
        return torch.relu(self.conv(torch.cat([x, skip], dim=1)))


def test_unet_traces_into_a_dag_with_its_skip_connections():
    model = UNet()
    graph = trace_module(model, (torch.randn(1, 3, 16, 16),))
    # The bottleneck is a Sequential: opened into its convolution and activation.
    assert graph.graph["order"] == ["enc.0", "enc.1", "bottleneck.0", "bottleneck.1", "dec.0", "dec.1", "head"]
    assert set(graph.edges) == {("enc.0", "enc.1"), ("enc.1", "bottleneck.0"), ("bottleneck.0", "bottleneck.1"),
                                ("bottleneck.1", "dec.0"), ("enc.1", "dec.0"), ("dec.0", "dec.1"),
                                ("enc.0", "dec.1"), ("dec.1", "head")}
    assert nx.is_directed_acyclic_graph(graph)
    # A 3x3 convolution from 3 to 8 channels on 16 x 16: 2 * 16*16 * 8 * 3*3*3 FLOPs.
    assert graph.nodes["enc.0"]["forward_flops"] == 2 * 16 * 16 * 8 * 27
    assert graph.nodes["enc.0"]["parameters"] == 8 * 27 + 8
    assert sum(graph.nodes[n]["parameters"] for n in graph) == sum(p.numel() for p in model.parameters())


class EncoderDecoder(nn.Module):
    def __init__(self, d=16, layers=2):
        super().__init__()
        self.encoder = nn.ModuleList([nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
                                      for _ in range(layers)])
        self.decoder = nn.ModuleList([nn.TransformerDecoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
                                      for _ in range(layers)])

    def forward(self, src, tgt):
        for layer in self.encoder:
            src = layer(src)
        for layer in self.decoder:
            tgt = layer(tgt, src)
        return tgt


def test_encoder_decoder_links_the_encoder_output_to_every_decoder_layer():
    graph = trace_module(EncoderDecoder(), (torch.randn(2, 5, 16), torch.randn(2, 7, 16)))
    assert ("encoder.1", "decoder.0") in graph.edges and ("encoder.1", "decoder.1") in graph.edges
    assert ("decoder.0", "decoder.1") in graph.edges and ("encoder.0", "encoder.1") in graph.edges
    assert list(nx.topological_sort(graph))[:2] == ["encoder.0", "encoder.1"]


def test_a_70b_llama_traces_without_memory():
    spec = load_model("llama3-70b")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = build_model(spec, 1024)
    graph = trace_module(model, (torch.randint(0, spec.vocab_size, (1, 1024), device="meta"),))
    grown_bytes = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    # 140 GB of bf16 weights never exist: the trace holds shapes, not tensors.
    assert grown_bytes < 2 << 30
    # One node per layer and per end: the graph grows with the model's modules, not its size.
    assert graph.number_of_nodes() == spec.num_hidden_layers + 3
    assert sum(graph.nodes[n]["parameters"] for n in graph) == 70_553_706_496
    assert len(repeats(graph)[graph.nodes["layers.0"]["signature"]]) == 80


@pytest.mark.parametrize("name", ["llama2-7b", "gpt3-6.7b"])
def test_saved_bytes_of_a_7b_layer_equal_the_cost_models_fp32_activations(name):
    """What autograd saves in one of the executor's layers (traced under fake CPU
    tensors, whose SDPA keeps no score matrix) is what costmodel.terms.memory charges a layer
    in fp32 (its eager-module counts, calibrated against MemTracker)."""
    from costmodel.specs.loading import load_cluster, make_training
    from costmodel.terms.memory import layer_activation_bytes

    spec = load_model(name)
    seq = 1024
    model = build_model(spec.__class__(**{**spec.__dict__, "num_hidden_layers": 2}), seq)
    graph = trace_module(model, (torch.zeros(1, seq, dtype=torch.long, device="meta"),))
    training = make_training(spec, load_cluster("cpu"), 8, seq, precision="fp32")
    predicted = layer_activation_bytes(spec, training, 1, 1, False, "none")
    assert graph.nodes["layers.0"]["saved_bytes"] == pytest.approx(predicted, rel=0.01)
