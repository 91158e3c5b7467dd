"""Decode steps on CPU as one C call each: the forward of a plain decode step (StepBatch.plain_decodes) recorded
once per batch size as a kernels/cpu/step_plan.py Plan over persistent buffers, then replayed (the CPU's answer to
CUDA graphs, serve/cuda_graphs.py).

Per step the host work is six small copies into the input buffers (token ids, positions, slots, block tables,
sequence lengths) and one call; the forward it replaces spent ~0.3 ms of Python per layer (issue 19: 5 ms of a
10 ms batch-1 W4 step on the bundled model). The recorded calls are the very kernels the eager forward calls, with
the same inputs and rounding, in the same order: the logits are the eager path's bit for bit (bf16, the only
dtype plans run in; tests/serve/test_cpu_step_plans.py). Per layer, the block's sublayer_norms in brackets
(models/blocks.py; Llama's pre-norm block has the attention-input and MLP-input ones):
  [x = norm(resid)]  qkv = linear(x) [+ bias]  [q, k = q_norm, k_norm]  [rope(q, k) unless NoPE]
  [q, k = q_norm, k_norm after RoPE]  [q *= query scale at its position]  kv_store(k, v)
  attn = paged attention(q)  o = linear(attn)  [o = norm(o)]
  [x = norm(o + resid -> resid)] or resid += o  act = act(gate(x)) * up(x) (or act(up(x)))  down = linear(act)
  [down = norm(down)]  resid += down
(a parallel block's MLP reads the attention's x; a MoE block's MLP is one moe_forward call, serve/cpu_moe.py, plus
its shared experts' MLP added after), then normed = norm(resid), logits = lm_head(normed). The norms
are RMSNorm's C kernel, or add_fp32_norm for the ones rounded once from fp32 (Gemma's, OLMo's, the LayerNorms).
A model or batch size the kernels do not cover (unsupported() and Plans.plan say which) runs eagerly, as before; an
lm_head without a C kernel (oneDNN's, outside batch-invariant serving) runs after the replay, on the final-normed
rows. Gemma's embedding scale and Granite's multipliers are scale calls (the embeddings after the gather, o and down
before their adds); logits scaling and soft-caps run after the replay (CausalLM.finish_logits).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from quantkit.kernels.cpu import logits as cpu_logits
from quantkit.kernels.cpu import moe as cpu_moe
from quantkit.kernels.cpu import step_plan
from quantkit.kernels.cpu.fused import CpuFusedOps, rope_table_rows
from quantkit.kernels.cpu.step_plan import Plan
from quantkit.models.attention import Attention, kernel_servable, position_scale
from quantkit.models.blocks import DecoderLayer
from quantkit.models.layers import (MLP, Fp32LayerNorm, Fp32RMSNorm, GeGLUMLP, GeluTanhMLP, LayerNorm, LayerNorm1P,
                                    OffsetRMSNorm, Relu2MLP, RMSNorm)
from quantkit.serve.attention import TorchPagedAttention
from quantkit.serve.cpu_moe import CpuCorrectedSoftmaxMoE, CpuGroupedTopKMoE, CpuMoE, CpuSharedExpertMoE
from quantkit.serve.cpu_plan_linears import record_fused, record_linear
from quantkit.serve.prepare import FusedAttention, FusedMLP

log = logging.getLogger("quantkit.serve")

MAX_PLAN_BATCH = 64  # sequences: above, a step's Python is a small share of its kernels and the buffers grow
# the norm classes the C kernels compute exactly
_NORMS = (RMSNorm, Fp32RMSNorm, OffsetRMSNorm, Fp32LayerNorm, LayerNorm, LayerNorm1P)
_GATED = {MLP: Plan.silu_mul, GeGLUMLP: Plan.gelu_tanh_mul}  # the MLPs of separate gate and up linears
_UP_DOWN = (Relu2MLP, GeluTanhMLP)  # the MLPs without gate
# the MoE blocks of one call (and their shared experts)
_PLAN_MOE = (CpuMoE, CpuSharedExpertMoE, CpuGroupedTopKMoE, CpuCorrectedSoftmaxMoE)


def unsupported(runner) -> Optional[str]:
    """Why `runner` (a ModelRunner, its attention backend built) cannot run plans, in a phrase; None when it can."""
    model = runner.model
    if runner.device.type != "cpu" or runner.dtype != torch.bfloat16:
        return f"{runner.device.type} {runner.dtype} (plans run bf16 on CPU)"
    if runner.cfg.tensor_parallel_size > 1:
        return "tensor parallelism"
    if not step_plan.available() or not isinstance(runner.fused_ops, CpuFusedOps):
        return "the C kernels are not built here (or attention_backend is not auto)"
    attn = runner.attn
    if not isinstance(attn, TorchPagedAttention):
        return f"the {type(attn).__name__} backend"
    if type(model.model.norm) not in _NORMS:
        return f"{model.family.name}'s final norm ({type(model.model.norm).__name__})"
    for i, layer in enumerate(model.model.layers):
        reason = _layer_unsupported(layer, attn, i)
        if reason is not None:
            return f"layer {i}: {reason}"
    return None


def _layer_unsupported(layer, attn: TorchPagedAttention, i: int) -> Optional[str]:
    sa = layer.self_attn
    if not isinstance(layer, DecoderLayer):
        return f"{type(layer).__name__} (plans record the blocks of models/blocks.py)"
    norms = [getattr(layer, name) for name in layer.sublayer_norms if name] + (
        [sa.q_norm, sa.k_norm] if sa.q_norm is not None else [])
    for norm in norms:
        if type(norm) not in _NORMS:
            return f"{type(norm).__name__} (a norm the C kernels compute)"
    if type(sa) not in (Attention, FusedAttention):
        return f"{type(sa).__name__}"
    if type(layer.ffn) not in (*_GATED, FusedMLP, *_UP_DOWN, *_PLAN_MOE):
        return f"{type(layer.ffn).__name__} (a dense MLP or a MoE block of serve/cpu_moe.py)"
    if layer.rotary is not None and layer.rotary.long_inv_freq is not None:
        return "longrope's frequencies, not settled for one serving length"
    if attn.rows_kernel is None and (attn.decode_kernel is None or not kernel_servable(sa.spec)):
        return "attention the decode kernel does not compute (sliding window or soft-cap)"
    return None


class Plans:
    """The plans of one ModelRunner (unsupported(runner) is None): persistent buffers for up to `top` sequences,
    which every batch size's plan uses a prefix of (plans run one at a time), and a plan per batch size, recorded
    on its first step (None: a linear has no C kernel at that size, the step runs eagerly)."""

    def __init__(self, runner):
        self.runner = runner
        cfg, mc = runner.cfg, runner.model.config
        self.top = min(cfg.max_num_seqs, cfg.max_num_batched_tokens, MAX_PLAN_BATCH)
        self.width = -(-runner.max_model_len // runner.block_size)  # block-table columns of the longest sequence
        top, i32 = self.top, torch.int32
        self.input_ids = torch.zeros(top, dtype=torch.int64)
        self.positions = torch.zeros(top, dtype=torch.int64)
        self.slots = torch.zeros(top, dtype=torch.int64)
        self.block_tables = torch.zeros(top, self.width, dtype=i32)
        self.seq_lens = torch.ones(top, dtype=i32)
        self.row_seqs = torch.arange(top, dtype=i32)  # row r is sequence r
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}
        self._rope: dict[int, torch.Tensor] = {}  # id(inv_freq) -> its table over every position
        self._scales: dict[tuple[float, int], torch.Tensor] = {}  # query_scale -> _query_scales' table
        self._moe_scratch: dict[tuple[int, int, int, int], cpu_moe.Scratch] = {}  # (H, I, E, k) -> its buffers
        self.plans: dict[int, Optional[Plan]] = {}
        self.eager_head: set[int] = set()  # batch sizes whose plan ends at the final norm
        self._logits32: Optional[torch.Tensor] = None  # fp32 [top, V]: the logits a step returns, valid until the next
        self.vocab = mc.vocab_size

    def plan(self, n: int) -> Optional[Plan]:
        if n not in self.plans:
            plan = Plan()
            try:
                ok = self._record(plan, n)
            except ValueError as e:  # a launcher's check: the eager path takes it
                log.warning("decode step plan of %d sequences not recorded (%s): those steps run eagerly", n, e)
                ok = False
            self.plans[n] = plan if ok else None
            if ok:
                log.info("recorded the decode step plan of %d sequences (%d kernel calls)", n, len(plan))
        return self.plans[n]

    def logits(self, batch, n: int) -> torch.Tensor:
        """A plain decode step of n sequences (plan(n) is not None) -> float32 logits [n, V] (row i: sequence i)."""
        meta, w = batch.meta, batch.meta.block_tables.shape[1]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :w].copy_(meta.block_tables)
        self.plan(n).run()
        model = self.runner.model
        if n in self.eager_head:
            return model.logits(self._buffer("normed", model.config.hidden_size)[:n])
        raw = self._buffer("logits", self.vocab)[:n]
        if not model.plain_logits or not cpu_logits.available():
            return model.finish_logits(raw)
        if self._logits32 is None:
            self._logits32 = torch.empty(self.top, self.vocab)
        return cpu_logits.to_float(raw, self._logits32[:n])  # finish_logits' float(), in a reused buffer

    def _buffer(self, name: str, cols: int) -> torch.Tensor:
        """A bf16 [top, cols] buffer, one per (name, width), shared by every plan."""
        key = (name, cols)
        if key not in self._buffers:
            self._buffers[key] = torch.zeros(self.top, cols, dtype=torch.bfloat16)
        return self._buffers[key]

    def _table(self, rotary) -> torch.Tensor:
        if id(rotary.inv_freq) not in self._rope:
            self._rope[id(rotary.inv_freq)] = rope_table_rows(rotary, self.runner.max_model_len)
        return self._rope[id(rotary.inv_freq)]

    def _query_scales(self, query_scale: tuple[float, int]) -> torch.Tensor:
        """bf16 [max_model_len]: the query scale at every position, as Attention.forward rounds it."""
        if query_scale not in self._scales:
            positions = torch.arange(self.runner.max_model_len)
            self._scales[query_scale] = position_scale(positions, *query_scale).to(torch.bfloat16)
        return self._scales[query_scale]

    # ---- recording: each returns False where a kernel does not take the call
    def _record(self, plan: Plan, n: int) -> bool:
        model = self.runner.model
        h = model.config.hidden_size
        resid = self._buffer("resid", h)[:n]
        plan.copy_rows(model.model.embed_tokens.weight, self.input_ids[:n], resid)
        embed_scale = model.embedding_scale(torch.bfloat16)
        if embed_scale is not None:  # CausalLM.embed's products
            plan.scale_rows(resid, embed_scale)
        if model.config.embedding_multiplier != 1.0:
            plan.scale_rows(resid, model.config.embedding_multiplier)
        for i, layer in enumerate(model.model.layers):
            if not self._block(plan, layer, i, resid):
                return False
        normed = self._buffer("normed", h)[:n]
        self._norm(plan, model.model.norm, resid, None, normed)
        if not record_linear(plan, model.lm_head, normed, self._buffer("logits", self.vocab)[:n]):
            self.eager_head.add(n)  # oneDNN's lm_head (no C entry point): called after the replay
        return True

    def _block(self, plan: Plan, layer, i: int, resid: torch.Tensor) -> bool:
        """resid [n, H] = layer(resid), as the block's forward computes it from its sublayer_norms."""
        n, h = resid.shape
        attn_in, attn_out, mlp_in, mlp_out = (name and getattr(layer, name) for name in layer.sublayer_norms)
        x = resid
        if attn_in is not None:
            x = self._norm(plan, attn_in, resid, None, self._buffer("normed", h)[:n])
        o = self._attention(plan, layer.self_attn, i, layer.rotary, x)
        if o is None:
            return False
        self._residual(plan, layer, o)
        if attn_out is not None:
            o = self._norm(plan, attn_out, o, None, self._buffer("o_normed", h)[:n])
        if mlp_in is not None:  # x = norm(o + resid), resid = o + resid
            x = self._norm(plan, mlp_in, o, resid, self._buffer("normed", h)[:n])
        else:
            plan.add_rows(resid, o)
            x = x if layer.parallel else resid
        down = (self._moe if type(layer.ffn) in _PLAN_MOE else self._mlp)(plan, layer.ffn, x)
        if down is None:
            return False
        self._residual(plan, layer, down)
        if mlp_out is not None:
            down = self._norm(plan, mlp_out, down, None, self._buffer("down_normed", h)[:n])
        plan.add_rows(resid, down)
        return True

    @staticmethod
    def _norm(plan: Plan, norm, x: torch.Tensor, residual: Optional[torch.Tensor], out: torch.Tensor):
        """out = norm(x + residual), residual = x + residual in place (None: out = norm(x)), as norm's forward and
        add_and_norm compute it (a class of _NORMS) -> out."""
        if type(norm) is RMSNorm:
            plan.add_rms_norm(x, residual, residual, norm.weight, out, norm.eps)
        else:
            weight, offset = norm.scaling()  # (a new tensor for LayerNorm1P: the plan holds it)
            plan.add_fp32_norm(x, residual, residual, weight, out, norm.eps, offset, norm.centered, norm.bias)
        return out

    @staticmethod
    def _residual(plan: Plan, layer, y: torch.Tensor) -> None:
        """y = layer.residual(y) in place: a sublayer's output times the block's residual_multiplier (Granite)."""
        if layer.residual_multiplier != 1.0:
            plan.scale_rows(y, layer.residual_multiplier)

    def _attention(self, plan: Plan, sa, i: int, rotary, x: torch.Tensor) -> Optional[torch.Tensor]:
        n = x.shape[0]
        hq, hkv, d = sa.n_heads, sa.n_kv, sa.head_dim
        if isinstance(sa, FusedAttention):
            qkv = self._buffer("qkv", (hq + 2 * hkv) * d)[:n]
            if not record_fused(plan, sa.fused_qkv, x, qkv):
                return None
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        else:
            q, k, v = (self._buffer(name, heads * d)[:n] for name, heads in (("q", hq), ("k", hkv), ("v", hkv)))
            if not all(record_linear(plan, lin, x, y) for lin, y in ((sa.q_proj, q), (sa.k_proj, k), (sa.v_proj, v))):
                return None
        if sa.q_norm is not None and not sa.qk_norm_after_rope:
            q, k = self._qk_norms(plan, sa, q, k)
        q, k, v = q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d)
        if rotary is not None:  # None: a NoPE layer, no rope call recorded
            plan.rope(q, k, self.positions[:n], self._table(rotary))
        if sa.q_norm is not None and sa.qk_norm_after_rope:
            q, k = self._qk_norms(plan, sa, q.flatten(1), k.flatten(1))
            q, k = q.view(n, hq, d), k.view(n, hkv, d)
        if sa.query_scale is not None:  # Ministral 3
            plan.scale_rows_at(q.flatten(1), self.positions[:n], self._query_scales(sa.query_scale))
        k_cache, v_cache = self.runner.attn.kv_caches[i]
        plan.kv_store(k, v, k_cache, v_cache, self.slots[:n])
        if not q.is_contiguous():
            qc = self._buffer("q_rows", hq * d)[:n].view(n, hq, d)
            plan.copy_rows(q, None, qc)
            q = qc
        out = self._buffer("attn", hq * d)[:n]
        tables, lens, spec = self.block_tables[:n], self.seq_lens[:n], sa.spec
        if self.runner.attn.rows_kernel is not None:
            plan.paged_rows(q, k_cache, v_cache, tables, self.row_seqs[:n], lens, spec.scale, out.view(n, hq, d),
                            spec.sliding_window, spec.logit_softcap)
        else:
            plan.paged_decode(q, k_cache, v_cache, tables, lens, spec.scale, out.view(n, hq, d))
        o = self._buffer("o", sa.o_proj.out_features)[:n]
        return o if record_linear(plan, sa.o_proj, out, o) else None

    def _qk_norms(self, plan: Plan, sa, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [n, Hq * D], k [n, Hkv * D] (rows at stride) -> (q_norm(q), k_norm(k)) in contiguous buffers, each over
        its norm's width: per head, recorded token by token (heads are rows at stride D), or whole rows (OLMo 2)."""
        normed = []
        for x, norm, name in ((q, sa.q_norm, "q_normed"), (k, sa.k_norm, "k_normed")):
            n, width = x.shape[0], norm.weight.shape[0]
            out = self._buffer(name, x.shape[1])[:n]
            if width == x.shape[1]:
                self._norm(plan, norm, x, None, out)
            else:
                for t in range(n):
                    self._norm(plan, norm, x[t].view(-1, width), None, out[t].view(-1, width))
            normed.append(out)
        return normed[0], normed[1]

    def _moe(self, plan: Plan, moe: CpuMoE, x: torch.Tensor) -> Optional[torch.Tensor]:
        """x [n, H] contiguous -> moe(x): one moe_forward call [+ the shared experts' MLP, added after (Qwen2-MoE's
        gated by sigmoid_gated_add)]."""
        n, calls = x.shape[0], moe.expert_calls
        if not calls.takes(x):
            return None
        key = (calls.hidden, calls.inter, calls.experts, calls.routing.top_k)
        if key not in self._moe_scratch:
            self._moe_scratch[key] = cpu_moe.Scratch(self.top, calls)
        out = self._buffer("moe", calls.hidden)[:n]
        cpu_moe.record(plan, x, calls, self._moe_scratch[key], out)
        shared_mlp = moe.shared_expert if isinstance(moe, CpuSharedExpertMoE) else moe.shared_experts
        if shared_mlp is not None:
            shared = self._mlp(plan, shared_mlp, x)
            if shared is None:
                return None
            if isinstance(moe, CpuSharedExpertMoE):
                cpu_moe.record_gated_add(plan, out, shared, x, moe.shared_gate)
            else:
                plan.add_rows(out, shared)
        return out

    def _mlp(self, plan: Plan, mlp, x: torch.Tensor) -> Optional[torch.Tensor]:
        n, inter = x.shape[0], mlp.down_proj.in_features
        act = self._buffer("act", inter)[:n]
        if type(mlp) in _UP_DOWN:
            up = self._buffer("up", inter)[:n]
            if not record_linear(plan, mlp.up_proj, x, up):
                return None
            plan.activation(up, act, mlp.activation)
        elif isinstance(mlp, FusedMLP):
            if not record_fused(plan, mlp.fused_gate_up, x, act):
                return None
        else:
            gate, up = self._buffer("gate", inter)[:n], self._buffer("up", inter)[:n]
            if not (record_linear(plan, mlp.gate_proj, x, gate) and record_linear(plan, mlp.up_proj, x, up)):
                return None
            _GATED[type(mlp)](plan, gate, up, act)
        down = self._buffer("down", mlp.down_proj.out_features)[:n]
        return down if record_linear(plan, mlp.down_proj, act, down) else None
