"""The vLLM backend's init info is checked where it is made (no vLLM needed: common.py imports none)."""

import pytest

from refit.config import TransferConfig
from refit.engines.vllm.common import RefitInitInfo
from refit.errors import ConfigError


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"load_path": "fast"}, r"RefitInitInfo.load_path must be one of auto, direct, loader, got 'fast'"),
        ({"n_workers": 0}, r"RefitInitInfo.n_workers must be an integer >= 1, got 0"),
        ({"n_trainer": 2.0}, r"RefitInitInfo.n_trainer must be an integer >= 1, got 2.0"),
        ({"master_port": 70000}, r"RefitInitInfo.master_port must be in 0..65535, got 70000"),
        ({"master_port": "29500"}, r"RefitInitInfo.master_port must be an integer port, got '29500'"),
    ],
)
def test_a_bad_field_is_refused_naming_it_and_its_value(kw, match):
    with pytest.raises(ConfigError, match=match):
        RefitInitInfo(**kw)


def test_the_buffer_fields_become_one_validated_transfer_config():
    info = RefitInitInfo(n_trainer=2, n_workers=4, num_buffers=3, buffer_bytes=1 << 20, timeout_s=7.0)
    assert info.world_size == 6
    assert info.transfer_config() == TransferConfig(
        num_buffers=3, buffer_bytes=1 << 20, preflight_timeout_s=7.0, name="xfer"
    )
    with pytest.raises(ConfigError, match=r"buffer_bytes must be an integer >= 64, got 32"):
        RefitInitInfo(buffer_bytes=32).transfer_config()
