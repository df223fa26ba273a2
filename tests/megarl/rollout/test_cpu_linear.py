"""SGLang's unquantized linears through megarl's CPU linear (megarl/rollout/sglang/cpu/linear.py):
fp32 CPU operands take ``parallel.cpu.linear.linear`` (oneDNN forced, whichever backend this machine
would choose) and equal float64 ``F.linear``, the oracle; fp64 keeps SGLang's own path. (The CPU
linear itself is tested in tests/parallel/cpu/test_linear.py.)"""

import pytest
import torch
import torch.nn.functional as F

from megarl.rollout.sglang.cpu.linear import patch_sglang_unquant_module
from parallel.cpu import linear as cpu_linear

pytestmark = pytest.mark.usefixtures("onednn_linears")


def test_sglang_unquantized_linears_take_it(monkeypatch):
    from megarl.rollout.sglang.cpu.stubs import install

    install()  # SGLang imports CUDA-only modules (triton, ...): the CPU stubs stand in
    from sglang.srt.layers.quantization import unquant

    patch_sglang_unquant_module(unquant)
    patch_sglang_unquant_module(unquant)  # idempotent: one wrapper, not two
    calls = []
    monkeypatch.setattr(cpu_linear, "linear", lambda *a: calls.append(a) or F.linear(*a))
    g = torch.Generator().manual_seed(7)
    x, weight, bias = torch.randn(9, 64, generator=g), torch.randn(48, 64, generator=g) * 0.1, torch.randn(48, generator=g)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    got = unquant.UnquantizedLinearMethod().apply(layer, x, bias)
    assert len(calls) == 1
    torch.testing.assert_close(got.double(), F.linear(x.double(), weight.double(), bias.double()),
                               rtol=1e-5, atol=1e-5)
    layer.weight = torch.nn.Parameter(weight.double(), requires_grad=False)  # fp64: SGLang's own path
    torch.testing.assert_close(unquant.UnquantizedLinearMethod().apply(layer, x.double()),
                               F.linear(x.double(), weight.double()))
    assert len(calls) == 1
