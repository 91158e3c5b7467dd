"""serve/cuda_linear.py's StackedLinear (q/k/v and gate/up as one matmul each on CUDA), on CPU: float parts through
F.linear, W4 parts through the Triton dequant-GEMM in the CPU interpreter (tests/kernels/triton_env.py), each
against its parts run alone; the parts' weights become views into the stacking; what does not stack; a model
whose Attention and MLP modules are stacked (serve/prepare.fuse_projections) against the same model unstacked; and
the whole CUDA preparation under the Triton attention in an engine, against the dense model's greedy tokens."""

from __future__ import annotations

from tests.kernels.triton_env import DEVICE, INTERPRET  # first: sets TRITON_INTERPRET before triton loads

import pytest
import torch
from torch import nn

from quantkit.config import QuantScheme
from quantkit.kernels.triton import qgemm
from quantkit.models.llama import LlamaForCausalLM, ModelConfig
from quantkit.quant.qlinear import QLinear
from quantkit.quant.scheme import quantize_rtn
from quantkit.serve.cuda_linear import StackedLinear
from quantkit.serve.prepare import FusedAttention, FusedMLP, fuse_projections
from tests.conftest import tiny_hf_config


def linears(sizes, k=64, bias=(), dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return [nn.Linear(k, n, bias=i in bias).to(DEVICE, dtype) for i, n in enumerate(sizes)]


def qlinears(sizes, k=256, bits=4, seed=0, act_order=False):
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(k, generator=gen)
    parts = []
    for n, b in zip(sizes, bits if isinstance(bits, tuple) else (bits,) * len(sizes)):
        w = torch.randn(n, k, generator=gen)
        qt = quantize_rtn(w, QuantScheme(bits=b, group_size=128, sym=False))
        if act_order:  # one visiting order for every part, as GPTQ's on one input: one permutation
            qt.g_idx = (torch.argsort(order) // 128).to(torch.int32)
        parts.append(QLinear.from_qtensor(qt.to(DEVICE)))
    return parts


@torch.inference_mode()
def test_float_parts_stack_into_views_and_give_their_own_outputs():
    parts = linears([64, 32, 32], bias=(1,))
    x = torch.randn(3, 5, 64, device=DEVICE)
    alone = [p(x) for p in parts]
    stacked = StackedLinear.of(parts)
    assert stacked is not None and stacked.weight.shape == (128, 64) and stacked.bias.shape == (128,)
    start = stacked.weight.data_ptr()
    assert [p.weight.data_ptr() for p in parts] == [start, start + 64 * 64 * 4, start + 96 * 64 * 4]  # views
    got = stacked(x)
    assert [g.shape for g in got] == [(3, 5, 64), (3, 5, 32), (3, 5, 32)]
    for g, a, p in zip(got, alone, parts):
        torch.testing.assert_close(g, a, rtol=0, atol=1e-5)
        assert torch.equal(p(x), a)  # a part alone reads its view: the same weight


@pytest.mark.parametrize("act_order", [False, True], ids=["plain", "act-order"])
@torch.inference_mode()
def test_w4_parts_stack_their_packed_weights(act_order):
    """The stacked GEMM's columns are each part's: bit for bit in the interpreter (one config, the same K tiles and
    splits); compiled, the autotuner may split K otherwise for the wider N, to fp16 rounding."""
    parts = qlinears([64, 32, 32], act_order=act_order)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.float16)
    alone = [qgemm.matmul(x, p.prepared("triton")) for p in parts]
    stacked = StackedLinear.of(parts)
    assert stacked is not None and stacked.packed.out_features == 128
    assert (stacked.packed.perm is not None) == act_order
    for g, a, p in zip(stacked(x), alone, parts):
        if INTERPRET:
            assert torch.equal(g, a)
        else:
            torch.testing.assert_close(g, a, rtol=4e-3, atol=2e-2)
        assert torch.equal(qgemm.matmul(x, p.prepared("triton")), a)  # the part alone, on its column view
        assert p.prepared("triton").qweight.stride(0) == 128  # a view into the stacking


def test_what_does_not_stack():
    assert StackedLinear.of(qlinears([64, 32], bits=(4, 8))) is None  # two packings
    assert StackedLinear.of([*qlinears([32]), *linears([32], k=256)]) is None  # two kinds
    assert StackedLinear.of(linears([32, 32], dtype=torch.float32)[:1] + linears([32], dtype=torch.float16)) is None
    mlp = nn.Module()
    assert StackedLinear.of(linears([32, 64]), mlp) is None  # gate and up of two widths
    assert StackedLinear.of(linears([32, 32], bias=(0,)), mlp) is None  # a biased gate


@torch.inference_mode()
def test_a_stacked_model_gives_its_unstacked_logits():
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.from_hf(tiny_hf_config(vocab_size=256))).to(DEVICE).eval()
    ids = torch.randint(3, 256, (2, 9), device=DEVICE)
    expected = model(ids)
    layers = len(model.model.layers)
    assert fuse_projections(model, StackedLinear.of) == 2 * layers
    assert all(isinstance(layer.self_attn, FusedAttention) and isinstance(layer.mlp, FusedMLP)
               for layer in model.model.layers)
    torch.testing.assert_close(model(ids), expected, rtol=0, atol=1e-5)


@torch.inference_mode()
def test_the_cuda_serving_path_composed_on_cpu_gives_the_dense_greedy_tokens():
    """What serve/prepare.py sets on CUDA (TritonOps, stacked projections) under the Triton paged attention, in an
    fp16 engine on CPU (the interpreter runs the kernels; fp16 leaves the CPU preparation out; on a GPU the
    engine's own CUDA preparation finds it done): greedy tokens equal the dense fp16 forward's, recomputed for
    every token."""
    from quantkit.kernels.triton.layer_ops import TritonOps
    from quantkit.models.layers import TorchOps
    from quantkit.models.loader import load_tokenizer
    from quantkit.serve.config import EngineConfig
    from quantkit.serve.engine import LLMEngine
    from quantkit.serve.sampling_params import SamplingParams
    from quantkit.serve.validation import validate_request

    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.from_hf(tiny_hf_config(vocab_size=512)))
    model.lm_head.weight.mul_(4.0)  # spread the logits: no near-ties in greedy comparisons
    model = model.to(DEVICE, torch.float16).eval()
    prompts = [[5, 9, 33, 2 + i, 71, 400 - i] * (i + 1) for i in range(3)]
    expected = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids], device=DEVICE))[0, -1].argmax()))
        expected.append(ids[len(prompt):])
    model.set_ops(TritonOps(TorchOps))
    assert fuse_projections(model, StackedLinear.of) == 4
    cfg = EngineConfig(block_size=4, kv_cache_memory=1 << 22, max_model_len=128, max_num_seqs=4,
                       attention_backend="triton")
    engine = LLMEngine(model, load_tokenizer(None), cfg, eos_token_ids=[2])
    layer = engine.runner.model.model.layers[0]  # the runner's CPU preparation left the CUDA one in place
    assert isinstance(layer.mlp, FusedMLP) and isinstance(layer.mlp.ops, TritonOps)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", validate_request(prompt, params, engine.vocab_size, engine.max_model_len,
                                                     engine.cfg.max_num_seqs))
    final = {}
    while engine.has_unfinished():
        final.update((out.request_id, out) for out in engine.step() if out.finished)
    assert [final[f"r{i}"].outputs[0].token_ids for i in range(3)] == expected
