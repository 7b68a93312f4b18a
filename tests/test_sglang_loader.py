"""refit's SGLang loader without SGLang: what its triggers may carry, and what it trusts.

The init trigger travels through SGLang's (pickled) request channel, so it is only a pointer to the job's
store; the loader acts on nothing until the store shows a document signed with the job secret that repeats
the pointer. A store signed with another secret, or a document that disagrees with the pointer, is refused;
a malformed trigger never raises out of ``load`` (that would kill SGLang's scheduler).
"""

from __future__ import annotations

import json

import pytest
import torch

from refit.engines.sglang import loader
from refit.engines.vllm.common import RefitInitInfo, open_store
from refit.errors import ConfigError
from refit.transport.authstore import StoreLost
from refit.transport.control import free_port


def _info(**kw) -> RefitInitInfo:
    base = dict(master_port=free_port(), n_trainer=2, n_workers=2, timeout_s=2.0, session="s", job_id="j1")
    return RefitInitInfo(**(base | kw))


def test_init_trigger_carries_the_store_pointer_and_no_secret():
    info = _info(secret="a-secret-of-at-least-16-chars")
    name = loader.init_trigger(info)
    assert name.startswith(loader.INIT) and "secret" not in name and info.secret not in name
    pointer = loader.parse_pointer(name[len(loader.INIT) :])
    assert (pointer.master_address, pointer.master_port, pointer.session, pointer.job_id) == (
        info.master_address,
        info.master_port,
        "s",
        "j1",
    )
    assert "secret" not in loader.init_document(info)


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[1, 2]",
        json.dumps({"master_address": "127.0.0.1", "master_port": 1, "session": "s"}),  # a key missing
        json.dumps({"master_address": "h", "master_port": 1, "session": "s", "job_id": "j", "n_workers": 9}),
        json.dumps({"master_address": "h", "master_port": "1", "session": "s", "job_id": "j"}),
        json.dumps({"master_address": "h", "master_port": 70000, "session": "s", "job_id": "j"}),
        json.dumps({"master_address": 5, "master_port": 1, "session": "s", "job_id": "j"}),
    ],
)
def test_malformed_pointers_are_refused(text):
    with pytest.raises(ConfigError):
        loader.parse_pointer(text)


def _host(info: RefitInitInfo, secret: str, doc: dict):
    """Host the job store (as trainer rank 0 does) and sign ``doc`` under the init key with ``secret``."""
    from dataclasses import replace

    store = open_store(replace(info, secret=secret), is_master=True)
    store.put(loader.INIT_KEY, doc)
    return store


def test_a_store_signed_with_another_secret_is_not_trusted(monkeypatch):
    info = _info()
    monkeypatch.setenv("REFIT_SECRET", "the-engine-secret-0123456789")
    host = _host(info, "a-stranger-secret-0123456789", loader.init_document(info))
    # the store serves only holders of its job's secret: the engine is refused at the handshake, with the reason
    with pytest.raises(StoreLost, match="refused this process.*another job secret"):
        loader.read_init(info, timeout_s=1.0)
    del host


def test_a_signed_document_must_repeat_the_pointer(monkeypatch):
    info = _info()
    secret = "the-job-secret-0123456789abcdef"
    monkeypatch.setenv("REFIT_SECRET", secret)
    doc = loader.init_document(info) | {"n_workers": 4}
    host = _host(info, secret, doc)
    store, got = loader.read_init(info, timeout_s=2.0)
    assert got.n_workers == 4  # the signed document, not the pointer, says how many workers
    host.put(loader.INIT_KEY, loader.init_document(info) | {"session": "other"})
    with pytest.raises(ConfigError, match="session"):
        loader.read_init(info, timeout_s=2.0)
    host.put(loader.INIT_KEY, loader.init_document(info) | {"extra": 1})
    with pytest.raises(ConfigError, match="unexpected fields"):
        loader.read_init(info, timeout_s=2.0)
    del host, store


def test_load_never_raises(caplog):
    model = torch.nn.Linear(2, 2)
    loader.load(model, [("refit.run", loader.trigger_tensor())])  # a run before any init
    loader.load(model, [("something else", loader.trigger_tensor())])
    loader.load(model, [("a", torch.zeros(1)), ("b", torch.zeros(1))])
    loader.load(model, [(loader.INIT + "{", loader.trigger_tensor())])
    assert caplog.text.count("the SGLang weight loader failed") == 4
