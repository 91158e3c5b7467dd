"""kernels/cpu/logits.py against torch: the bf16 -> fp32 conversion and the first maximum of each row, bit for bit
and index for index, with ties, infinities, NaN and denormals."""

from __future__ import annotations

import pytest
import torch

from quantkit.kernels.cpu import logits as cpu_logits

pytestmark = pytest.mark.skipif(not cpu_logits.available(), reason="the logits kernels did not build (no compiler?)")


def awkward_rows(rows: int, vocab: int) -> torch.Tensor:
    """fp32 rows with ties at the maximum (values on a coarse grid), and special rows: all -inf, +inf twice, NaN
    after a large value, a denormal-only row."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(rows, vocab, generator=gen) * 4).round() / 2  # many equal values: ties for the maximum
    x[1] = float("-inf")
    x[2, [7, 3]] = float("inf")
    x[3, 5], x[3, 9], x[3, 11] = 1e30, float("nan"), float("nan")
    x[4] = torch.rand(vocab, generator=gen) * 1e-40  # denormals
    return x


@pytest.mark.parametrize("rows, vocab", [(1, 49152), (7, 1000), (64, 4099)])
def test_first_argmax_is_torch_max_index(rows, vocab):
    x = awkward_rows(max(rows, 5), vocab)[:rows]
    assert torch.equal(cpu_logits.first_argmax(x), x.max(dim=-1).indices)
    strided = torch.cat([x, x], dim=1)[:, :vocab]  # rows at a stride of 2V
    assert torch.equal(cpu_logits.first_argmax(strided), strided.max(dim=-1).indices)


def test_first_argmax_keeps_torch_where_the_kernel_does_not_apply():
    x = awkward_rows(5, 300)
    assert torch.equal(cpu_logits.first_argmax(x.double()), x.double().max(dim=-1).indices)
    assert cpu_logits.first_argmax(x[:0]).shape == (0,)


def test_to_float_is_torch_float_bit_for_bit():
    x = awkward_rows(6, 4099).bfloat16()
    out = torch.full((8, 4099), 7.0)
    got = cpu_logits.to_float(x, out[:6])
    assert got.data_ptr() == out.data_ptr() and torch.equal(got.view(torch.int32), x.float().view(torch.int32))
    assert bool((out[6:] == 7.0).all())  # nothing past the rows written
    wide = torch.cat([x, x], dim=1)[:, :4099]
    assert torch.equal(cpu_logits.to_float(wide, torch.empty(6, 4099)).view(torch.int32),
                       x.float().view(torch.int32))


def test_to_float_refuses_what_it_does_not_take():
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    for bad_x, bad_out in ((x.float(), torch.empty(3, 64)), (x, torch.empty(3, 64, dtype=torch.float16)),
                           (x, torch.empty(2, 64)), (x.T, torch.empty(64, 3))):
        with pytest.raises(ValueError):
            cpu_logits.to_float(bad_x, bad_out)
