"""Weights warmed in L2 ahead of their products (kernels.triton_linear.weight_warmer): which product's weights are asked
for before which, that a layer's skinny path asks in the order it runs its products, and where no
warming happens. The side stream itself needs CUDA (benchmarks/gpu_check.py compares the tokens)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from zipage import kernels  # noqa: E402
from zipage.kernels import triton_linear  # noqa: E402


@pytest.mark.parametrize("count,ahead", [(8, 2), (8, 1), (5, 4), (3, 7), (112, 3)])
def test_every_product_is_warmed_once_at_most_ahead_products_before_it(count, ahead):
    order = triton_linear.warm_order(count, ahead)
    assert len(order) == count
    warmed_before = {}  # product -> the product before which its weights were asked for
    for k, due in enumerate(order):
        for j in due:
            assert j not in warmed_before, f"product {j} warmed twice"
            warmed_before[j] = k
    assert sorted(warmed_before) == list(range(count))
    for j, k in warmed_before.items():
        assert 0 <= j - k <= ahead  # never after its own product, never further ahead than asked
    assert order[0] == list(range(min(ahead + 1, count)))
    assert all(len(due) <= 1 for due in order[1:])  # one product's weights at each later fork


def test_no_warming_ahead_zero_or_no_products():
    assert triton_linear.warm_order(4, 0) == [[], [], [], []]
    assert triton_linear.warm_order(0, 2) == []


def test_no_warmer_off_on_the_cpu_or_for_large_products(monkeypatch):
    small = [torch.zeros(64, 64, dtype=torch.bfloat16) for _ in range(4)]
    monkeypatch.setattr(triton_linear, "WARM_AHEAD", 0)
    assert triton_linear.weight_warmer(small) is None
    monkeypatch.setattr(triton_linear, "WARM_AHEAD", 2)
    assert triton_linear.weight_warmer(small) is None  # CPU tensors: nothing to warm
    assert triton_linear.weight_warmer([]) is None


class RecordingWarmer:
    def __init__(self, log):
        self.log = log

    def before_product(self):
        self.log.append("warm")


@pytest.mark.parametrize("family", ["qwen3-tiny", "llama-tiny"])
def test_the_skinny_layer_asks_before_each_product_in_product_weights_order(family, monkeypatch):
    from test_triton_kernels import paged_cache

    from zipage.engine.execution.models import ForwardBatch
    from zipage.engine.execution.models.decoder import CausalLM
    from zipage.engine.loading.model_registry import RANDOM_PRESETS

    torch.manual_seed(0)
    model = CausalLM(RANDOM_PRESETS[family].make_config())
    model.init_random(seed=1)
    gen = torch.Generator().manual_seed(6)
    attn = model.attention_layers[0]
    for layer in model.attention_layers:
        layer.k_cache, layer.v_cache, table = paged_cache([9], 16, attn.num_kv_heads, attn.head_dim, gen)
    batch = ForwardBatch(is_prefill=False, slot_mapping=torch.tensor([8]), block_tables=table,
                         context_lens=torch.tensor([9], dtype=torch.int32))
    ids, positions = torch.tensor([3]), torch.tensor([8])
    log = []
    weights = [w for layer in model.model.layers for w in layer.product_weights()]
    for name in kernels.SKINNY_NAMES:  # log the weight each product reads, then compute it
        product = getattr(kernels, name)

        def logged(*args, product=product, **kw):
            log.append(next(a for a in args if any(a is w for w in weights)))
            return product(*args, **kw)

        monkeypatch.setattr(kernels, name, logged)

    def forward(warmer):
        hidden, residual = model._embed(ids), None
        cos_sin = model.rope.cos_sin(positions)
        for layer in model.model.layers:
            hidden, residual = layer(hidden, residual, cos_sin, batch, True, warmer)
        return hidden, residual

    with torch.no_grad():
        plain = forward(None)
        log.clear()
        warmed = forward(RecordingWarmer(log))
    for got, want in zip(warmed, plain):
        assert torch.equal(got, want)
    assert len(log) == 2 * len(weights) == 8 * len(model.model.layers)
    for k, weight in enumerate(weights):  # a warmer's turn just before each product, in this order
        assert isinstance(log[2 * k], str) and log[2 * k] == "warm"
        assert log[2 * k + 1] is weight
