"""The data plane used as a careless caller would: every bad input refused, naming what is wrong.

Each case was accepted (or failed with a raw torch error) before ``refit.data.inputs``: a bare string
put as its characters, ``1`` and ``"1"`` aliasing, ``None`` stored as ``"None"``, a non-string partition
or field name stored, ``seq_lens=-5`` stored and ``2.7`` truncated, a sample over the token cap put
alone in a microbatch, a sparse tensor failing inside torch.
"""

from __future__ import annotations

import pytest
import torch

from refit.data import InProcessStore, balanced_shards, pack_microbatches


def _store() -> InProcessStore:
    return InProcessStore()


def test_a_bare_string_of_keys_is_refused_naming_the_type():
    s = _store()
    with pytest.raises(TypeError, match="keys must be a sequence of str .* not one str"):
        s.put("abc", {"x": torch.zeros(3)})
    assert s.keys() == []  # not a, b, c
    with pytest.raises(TypeError, match="not one bytes"):
        s.put(b"ab", {"x": torch.zeros(2)})


@pytest.mark.parametrize("key", [1, None, 1.5, ("a",)])
def test_a_key_that_is_not_a_str_is_refused(key):
    s = _store()
    s.put(["1"], {"x": torch.zeros(1)})
    with pytest.raises(TypeError, match=rf"keys\[1\] is a {type(key).__name__} .*not a str"):
        s.put(["ok", key], {"x": torch.ones(2)})
    with pytest.raises(TypeError, match="not a str"):
        s.get([key], select_fields=["x"])
    with pytest.raises(TypeError, match="not a str"):
        s.clear([key])
    assert s.keys() == [("default", "1")]  # 1 did not alias "1"; nothing half-written


def test_an_unordered_collection_of_keys_is_refused():
    with pytest.raises(TypeError, match="a sequence of str .* got a set"):
        _store().put({"a", "b"}, {"x": torch.zeros(2)})


@pytest.mark.parametrize("partition", [1, None, b"p", ""])
def test_a_partition_that_is_not_a_nonempty_str_is_refused(partition):
    s = _store()
    with pytest.raises((TypeError, ValueError), match="partition"):
        s.put(["a"], {"x": torch.zeros(1)}, partition=partition)
    assert s.keys() == []


@pytest.mark.parametrize("name", [1, None, ("x",), ""])
def test_a_field_name_that_is_not_a_nonempty_str_is_refused(name):
    s = _store()
    with pytest.raises((TypeError, ValueError), match="field name"):
        s.put(["a"], {name: torch.zeros(1)})
    s.put(["a"], {"x": torch.zeros(1)})
    with pytest.raises((TypeError, ValueError), match="select_fields"):
        s.get(["a"], select_fields=[name])


@pytest.mark.parametrize(
    "lens, match",
    [
        ([-5], r"seq_lens\[0\] is -5; lengths are >= 0"),
        ([2.7], r"seq_lens\[0\] is a float \(2.7\), not an int"),
        ([True], r"seq_lens\[0\] is a bool"),
        (["7"], r"seq_lens\[0\] is a str"),
        (torch.tensor([2.5]), "must hold integers, got a tensor of torch.float32"),
    ],
)
def test_seq_lens_must_be_non_negative_ints(lens, match):
    s = _store()
    with pytest.raises((TypeError, ValueError), match=match):
        s.put(["a"], {"x": torch.zeros(1)}, seq_lens=lens)
    assert s.keys() == []
    s.put(["a"], {"x": torch.zeros(1)}, seq_lens=torch.tensor([3]))  # an integer tensor is fine
    assert s.meta(["a"]).seq_lens == (3,)


def test_balanced_shards_refuses_float_and_negative_lengths():
    with pytest.raises(TypeError, match=r"lengths\[1\] is a float \(2.7\)"):
        balanced_shards([4, 2.7], 1, 10)
    with pytest.raises(ValueError, match=r"lengths\[0\] is -5"):
        balanced_shards([-5, 1], 1, 10)


def test_a_sample_over_the_token_cap_is_refused_naming_it_and_the_cap():
    with pytest.raises(ValueError, match="sample 2 has 50 tokens, over max_tokens_per_microbatch=40"):
        balanced_shards([10, 10, 50, 10], 2, 40)
    with pytest.raises(ValueError, match="sample 1 has 9 tokens, over the budget of 8"):
        pack_microbatches([0, 1], [3, 9], 8)


def test_unsupported_tensor_layouts_are_refused_naming_the_field():
    s = _store()
    sparse = torch.eye(2).to_sparse()
    with pytest.raises(ValueError, match="field 'ids' is a torch.sparse_coo tensor; only dense"):
        s.put(["a", "b"], {"ids": sparse})
    with pytest.raises(ValueError, match="field 'rows' is a torch.sparse_csr tensor"):
        s.put(["a"], {"rows": [torch.eye(2).to_sparse_csr()]})
    with pytest.raises(ValueError, match="field 'm' is a meta tensor"):
        s.put(["a"], {"m": torch.zeros(1, device="meta")})
    with pytest.raises(TypeError, match="field 'd' is a dict"):
        s.put(["a"], {"d": {"not": "rows"}})
    assert s.keys() == []
