"""The Triton fused MoE (kernels/triton/fused_moe.py) and its serving swap (serve/moe_fusion.py).

Runs under TRITON_INTERPRET=1 on CPU (tests/kernels/triton_env.py). The alignment is compared slot for slot with a
plain-Python construction; fused_moe with its torch reference fused_moe_ref over routings with a starved expert,
every token on one pair of experts, a decode step (T=1) and T not a multiple of BLOCK_M; and the fused block with
MoE.forward of real quantkit MoE blocks (tiny random Mixtral, Qwen2-MoE, Hunyuan MoE, GLM-4.5 and ERNIE 4.5 MoE from
transformers, tests/quantkit/families.py, saved and read by quantkit's loader), fp32 within 1e-5, bf16/fp16 within
TOL.
Packed experts (W4 g16 act-order, W8 per-channel): the reference's weights equal scheme.dequantize of each QTensor,
the kernel equals the reference, and a Mixtral block with QLinear experts equals its own module forward.
"""

from __future__ import annotations

from tests.kernels.triton_env import DEVICE  # first: sets TRITON_INTERPRET before triton loads

import copy
import functools
from pathlib import Path

import pytest
import torch
from torch import nn

from quantkit.config import QuantScheme
from quantkit.kernels.triton.fused_moe import align_block_size, fused_moe, fused_moe_ref
from quantkit.kernels.triton.packed_experts import dequantize_experts_ref, stack_packed
from quantkit.kernels.triton.repack import repack
from quantkit.models.config import ModelConfig
from quantkit.files import read_safetensors
from quantkit.models.loader import load_state, tensor_names_of
from quantkit.models.model import CausalLM
from quantkit.models.moe import MoE
from quantkit.quant import scheme
from quantkit.quant.qlinear import QLinear
from quantkit.serve.moe_fusion import (FusedCorrectedSoftmaxMoE, FusedGroupedTopKMoE, FusedMoE, FusedSharedExpertMoE,
                                       fuse_moe, fuse_moe_block)
from quantkit.serve.prepare import prepare_model
from tests.quantkit.families import random_hf_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# bf16/fp16: the GEMMs' fp32 sums differ in order from torch's, so a rounded intermediate may differ by an ulp
# (about 2 ulps of the output here; measured under the interpreter: bf16 bit-identical, fp16 <= 1 ulp)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=8e-3, atol=8e-3)}
H, I, E, K = 64, 48, 8, 2
BM = 16  # the interpreter's BLOCK_M (fused_moe.INTERPRETER_CONFIG)


def routing(case: str, g: torch.Generator) -> torch.Tensor:
    """experts [T, 2] (two distinct experts per token, as top-k gives) for each routing case."""
    if case == "decode":
        return torch.tensor([[5, 2]])
    if case == "one_pair":  # every token on experts 6 and 1 (T=24 > BM: two blocks each)
        return torch.tensor([[6, 1]]).repeat(24, 1)
    t = 37  # not a multiple of BM
    chosen = torch.rand(t, E, generator=g).topk(K, dim=-1).indices
    if case == "starved":  # expert 3 gets no token
        chosen = torch.rand(t, E - 1, generator=g).topk(K, dim=-1).indices
        chosen = chosen + (chosen >= 3).long()
    return chosen


CASES = ["random", "starved", "one_pair", "decode"]


def expected_alignment(experts: torch.Tensor, block_m: int, capacity: int) -> tuple[list[int], list[int]]:
    """Plain Python: each expert's slots ascending, padded with T*k to a multiple of block_m, in expert order."""
    flat, sentinel = experts.flatten().tolist(), experts.numel()
    slots, blocks = [], []
    for e in range(E):
        mine = [s for s, x in enumerate(flat) if x == e]
        run = -(-len(mine) // block_m) * block_m
        slots += mine + [sentinel] * (run - len(mine))
        blocks += [e] * (run // block_m)
    return slots + [sentinel] * (capacity - len(slots)), blocks + [-1] * (capacity // block_m - len(blocks))


@pytest.mark.parametrize("block_m", [4, BM])
@pytest.mark.parametrize("case", CASES)
def test_alignment_sorts_pads_and_labels_every_block(case, block_m):
    experts = routing(case, torch.Generator().manual_seed(1))
    slots, block_expert = align_block_size(experts, E, block_m)
    assert slots.dtype == block_expert.dtype == torch.int32
    same = align_block_size(experts.int(), E, block_m)  # int32 ids (any integer dtype) alike
    assert torch.equal(same[0], slots) and torch.equal(same[1], block_expert)
    assert slots.numel() == block_expert.numel() * block_m
    want_slots, want_blocks = expected_alignment(experts, block_m, slots.numel())
    assert slots.tolist() == want_slots and block_expert.tolist() == want_blocks
    real = slots[slots < experts.numel()]
    assert sorted(real.tolist()) == list(range(experts.numel()))  # every slot exactly once
    for b, e in enumerate(block_expert.tolist()):  # each block holds one expert's slots (or only padding)
        block = slots[b * block_m:(b + 1) * block_m].long()
        inside = experts.flatten()[block[block < experts.numel()]]
        assert (inside == e).all() and (e >= 0) == (inside.numel() > 0)


def random_experts(dtype, g):
    w_gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.15).to(DEVICE, dtype)
    w_down = (torch.randn(E, H, I, generator=g) * 0.15).to(DEVICE, dtype)
    return w_gate_up, w_down


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_fused_moe_equals_reference(dtype, case):
    g = torch.Generator().manual_seed(2)
    experts = routing(case, g)
    weights = torch.softmax(torch.randn(experts.shape, generator=g), dim=-1)  # fp32, Mixtral-like
    if dtype != torch.float32:
        weights = weights.to(dtype)  # Qwen keeps them in the model dtype
    x = torch.randn(experts.shape[0], H, generator=g).to(DEVICE, dtype)
    w_gate_up, w_down = random_experts(dtype, g)
    args = (x, w_gate_up, w_down, weights.to(DEVICE), experts.to(DEVICE))
    out, ref = fused_moe(*args), fused_moe_ref(*args)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_launcher_refuses_mismatched_inputs():
    g = torch.Generator().manual_seed(3)
    w_gate_up, w_down = random_experts(torch.float32, g)
    x, experts = torch.randn(3, H, device=DEVICE), torch.zeros(3, K, dtype=torch.long, device=DEVICE)
    weights = torch.ones(3, K, device=DEVICE)
    with pytest.raises(AssertionError, match="in x.dtype"):
        fused_moe(x.half(), w_gate_up, w_down, weights, experts)
    with pytest.raises(AssertionError, match="w_down"):
        fused_moe(x, w_gate_up, w_down[:, :, :-1], weights, experts)


# (bits, group_size, sym, act_order): W4 groups of 16 (under a 32-row K tile: scales gathered per row) sym with
# act-order, W8 per-channel asym (one scale row per tile)
SCHEMES = {"w4g16-sym-act": (4, 16, True, True), "w8ch-asym": (8, -1, False, False)}


def quantized(w: torch.Tensor, bits, group_size, sym, g_idx=None) -> scheme.QTensor:
    """w [N, K] min/max-quantized by quantkit's scheme (columns grouped by g_idx when given)."""
    q = QuantScheme(bits=bits, group_size=group_size, sym=sym)
    scales, zeros = scheme.fit_qparams(w, q, g_idx)
    return scheme.QTensor(scheme.quantize(w, scales, zeros, bits, group_size, g_idx), zeros, scales, g_idx, bits,
                          group_size, sym)


def act_order(k: int, group_size: int, g: torch.Generator) -> torch.Tensor:
    """A GPTQ-style g_idx [K]: columns visited in a random order, the i-th visited joins group i // group_size."""
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[torch.randperm(k, generator=g)] = (torch.arange(k) // group_size).to(torch.int32)
    return g_idx


@functools.cache
def packed_experts(name: str):
    """(gate/up and down PackedExperts, their QTensors) of SCHEMES[name]: gate and up of an expert share one
    act-order g_idx (they share their input, so GPTQ orders their columns alike)."""
    bits, group_size, sym, act = SCHEMES[name]
    g = torch.Generator().manual_seed(5)
    qts = []
    for _ in range(E):
        gi = act_order(H, group_size, g) if act else None
        qts.append([quantized(torch.randn(I, H, generator=g) * 0.15, bits, group_size, sym, gi) for _ in range(2)]
                   + [quantized(torch.randn(H, I, generator=g) * 0.15, bits, group_size, sym,
                                act_order(I, group_size, g) if act else None)])
    qts = [[qt.to(DEVICE) for qt in expert] for expert in qts]
    gate_up = stack_packed([[repack(gate), repack(up)] for gate, up, _ in qts])
    down = stack_packed([[repack(down)] for _, _, down in qts])
    return gate_up, down, qts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(SCHEMES))
def test_fused_moe_on_packed_experts_equals_reference(name, dtype):
    gate_up, down, qts = packed_experts(name)
    # the reference's weights are the format's (scheme.dequantize of each QTensor)
    torch.testing.assert_close(dequantize_experts_ref(gate_up), torch.stack(
        [torch.cat([scheme.dequantize(gate), scheme.dequantize(up)]) for gate, up, _ in qts]), rtol=0, atol=0)
    torch.testing.assert_close(dequantize_experts_ref(down), torch.stack([scheme.dequantize(d) for _, _, d in qts]),
                               rtol=0, atol=0)
    g = torch.Generator().manual_seed(7)
    for case in ("random", "decode"):
        experts = routing(case, g)
        weights = torch.softmax(torch.randn(experts.shape, generator=g), dim=-1)
        x = torch.randn(experts.shape[0], H, generator=g).to(DEVICE, dtype)
        args = (x, gate_up, down, weights.to(DEVICE), experts.to(DEVICE))
        torch.testing.assert_close(fused_moe(*args), fused_moe_ref(*args), **TOL[dtype])


def test_gate_and_up_of_different_act_orders_do_not_stack():
    g = torch.Generator().manual_seed(6)
    parts = [repack(quantized(torch.randn(I, H, generator=g), 4, 32, True, act_order(H, 32, g)).to(DEVICE))
             for _ in range(2)]
    assert stack_packed([parts]) is None and stack_packed([[parts[0]], [parts[1]]]) is not None


FAMILY_CONFIGS = {  # small enough for the interpreter: E=8, I=48 (Mixtral) / E=6, I=32 plus a shared expert
    "mixtral": ("mixtral", dict(num_local_experts=E, num_experts_per_tok=K, intermediate_size=I, num_hidden_layers=1)),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=6, num_experts_per_tok=K, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=64, num_hidden_layers=1)),
    "hunyuan_moe": ("hunyuan_v1_moe", dict(num_experts=6, moe_topk=K, intermediate_size=32, head_dim=16,
                                           num_hidden_layers=1)),  # plain MoE with shared experts (shared_mlp)
    "glm4_moe": ("glm4_moe", dict(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=K,
                                  moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=0,
                                  head_dim=16, num_hidden_layers=1)),  # grouped sigmoid, fp32 router
    "ernie4_5_moe": ("ernie4_5_moe", dict(moe_num_experts=6, moe_k=K, moe_intermediate_size=32,
                                          moe_num_shared_experts=1, moe_layer_start_index=0, head_dim=16,
                                          num_hidden_layers=1)),  # corrected softmax, fp32 router
}


def quantkit_model(name: str, folder: Path) -> CausalLM:
    """The tiny random transformers model of this family, saved by transformers into `folder` and its weights read
    into quantkit's CausalLM by the loader (fp32)."""
    model_type, extra = FAMILY_CONFIGS[name]
    hf = random_hf_model(model_type, **extra)
    hf.save_pretrained(folder)
    with torch.device("meta"):
        model = CausalLM(ModelConfig.from_hf(hf.config.to_dict()))
    load_state(model, read_safetensors(folder, tensor_names_of(folder)), folder, torch.float32)
    return model.eval()


def moe_block(model: CausalLM) -> MoE:
    return getattr(model.model.layers[0], model.family.ffn_name)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {name: quantkit_model(name, tmp_path_factory.mktemp(name)) for name in FAMILY_CONFIGS}


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
@torch.no_grad()
def test_fused_block_equals_moe_forward_with_the_same_state(name, dtype, models):
    block = copy.deepcopy(moe_block(models[name])).to(DEVICE, dtype)
    reference = copy.deepcopy(block)
    state = block.state_dict()
    params = dict(block.named_parameters())
    assert fuse_moe_block(block)
    assert type(block) is {"mixtral": FusedMoE, "qwen2_moe": FusedSharedExpertMoE, "hunyuan_moe": FusedMoE,
                           "glm4_moe": FusedGroupedTopKMoE, "ernie4_5_moe": FusedCorrectedSoftmaxMoE}[name]
    # same keys, values and Parameter objects; each expert weight a view into the stacked tensors
    assert block.state_dict().keys() == state.keys() and dict(block.named_parameters()) == params
    for key, value in block.state_dict().items():
        assert torch.equal(value, state[key]), key
    expert, inter = block.experts[2], block.w_down.shape[2]
    assert expert.up_proj.weight.data_ptr() == block.w_gate_up[2, inter:].data_ptr()
    assert expert.down_proj.weight.data_ptr() == block.w_down[2].data_ptr()
    g = torch.Generator().manual_seed(4)
    for shape in ((1, 1, H), (2, 19, H)):  # a decode step; 38 tokens of two sequences
        x = torch.randn(shape, generator=g).to(DEVICE, dtype)
        torch.testing.assert_close(block(x), reference(x), **TOL[dtype])


def quantize_experts(block: MoE, bits, group_size, sym) -> None:
    """Every expert Linear of `block` -> the QLinear of its min/max-quantized weight, in place."""
    for expert in block.experts:
        for name, linear in list(expert.named_children()):
            qt = quantized(linear.weight.detach().float(), bits, group_size, sym)
            setattr(expert, name, QLinear.from_qtensor(qt).to(DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.no_grad()
def test_fused_block_with_quantized_experts_equals_moe_forward(dtype, models):
    """Mixtral with W4 g16 asymmetric experts: the module path through QLinear's own CPU forward is the reference."""
    block = copy.deepcopy(moe_block(models["mixtral"])).to(DEVICE, dtype)
    quantize_experts(block, 4, 16, False)
    reference = copy.deepcopy(block)
    state = block.state_dict()
    assert fuse_moe_block(block) and type(block) is FusedMoE
    assert block.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in block.state_dict().items())
    x = torch.randn(2, 19, H, generator=torch.Generator().manual_seed(8)).to(DEVICE, dtype)
    torch.testing.assert_close(block(x), reference(x), **TOL[dtype])


@torch.no_grad()
def test_mixed_experts_and_cpu_serving_keep_the_module_path(models):
    block = copy.deepcopy(moe_block(models["mixtral"]))
    block.experts[1].w2 = QLinear(I, H, bits=4, group_size=16, sym=True)  # one quantized part among floats
    assert not fuse_moe_block(block) and type(block) is MoE
    model = copy.deepcopy(models["qwen2_moe"])
    prepare_model(model, torch.device("cpu"), torch.float32, batch_hint=16, fused_ops=False)
    assert type(moe_block(model)).__name__ == "SharedExpertMoE"
    assert fuse_moe(model) == 1 and fuse_moe(model) == 0  # one sparse layer; a fused block is left alone
