"""Parameter shapes kept on disk (refit.layout.shape_cache): what a cached read returns is exactly what building
the model on the meta device returns, for presets and config files; a file that is not shapes is ignored and
written anew; the key follows the config's text and the dtype asked for; ``REFIT_CACHE_DIR=""`` keeps nothing."""

import json

import pytest
import torch

from refit.layout import shape_cache
from refit.layout.models import PRESETS, param_shapes


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(shape_cache.CACHE_ENV, str(tmp_path))
    return tmp_path / "shapes"


def _files(folder):
    return sorted(folder.glob("*.json")) if folder.exists() else []


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3-moe", "deepseek-v3"])
def test_a_cached_read_equals_the_meta_model_and_each_dtype_has_its_own_entry(cache, model):
    assert model in PRESETS
    first = param_shapes(model)
    (stored,) = _files(cache)
    assert param_shapes(model) == first  # read back from the file
    assert json.loads(stored.read_text())[0][0] == first[0][0]
    half = param_shapes(model, torch.float16)
    assert len(_files(cache)) == 2 and {d for _, _, d in half} == {torch.float16}
    assert [(n, s) for n, s, _ in half] == [(n, s) for n, s, _ in first]


def test_a_config_file_is_keyed_by_its_text_and_junk_in_the_cache_is_written_anew(cache, tmp_path):
    from refit.layout.models import _TINY

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", **_TINY}))
    first = param_shapes(str(path))
    (stored,) = _files(cache)
    stored.write_text('[["model.embed_tokens.weight", [-1], "float32"]]')  # not a shape: ignored
    assert param_shapes(str(tmp_path)) == first  # the folder names the same file
    assert json.loads(stored.read_text()) == [[n, list(s), str(d).removeprefix("torch.")] for n, s, d in first]
    path.write_text(json.dumps({"model_type": "llama", **_TINY, "vocab_size": 640}))
    other = param_shapes(str(path))
    assert len(_files(cache)) == 2 and other[0][1] == (640, 128) and first[0][1] == (512, 128)


def test_an_empty_cache_dir_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(shape_cache.CACHE_ENV, "")
    assert shape_cache.cache_dir() is None
    assert param_shapes("tiny-llama")[0] == ("model.embed_tokens.weight", (512, 128), torch.float32)
    assert list(tmp_path.iterdir()) == []
