"""The data plane across hosts: Ray's head on host a, a rollout worker on host b, ``--dp`` readers on host c.

    sudo .venv/bin/python -m bench.cluster_dataplane [--rate 1gbit --samples 512 --seq 8192 --dp 4 --rounds 12]
        [--store-host b] [--tq-path /opt/transferqueue-0.1.11] [--out bench/results/cpu-cluster-dataplane.json]

Three hosts of a ``refit.tools.cluster`` cluster (network namespaces, each link shaped to ``--rate`` both ways),
joined into one Ray cluster by Ray's own multi-node start (``ray start --head`` inside host a, ``ray start
--address`` inside hosts b and c, each with ``--node-ip-address`` its host's address and a resource naming the
host, so that actors are placed by host). The driver runs on host a. Each round, every method in a fresh random
order (seeded), each timed at the driver from the put's call to the last reader done:

- ``put_get``: the rollout worker on b puts one batch (int64 ids + float32 logprobs, [samples, seq]); one reader
  on c gets every row (views where the method gives them);
- ``dp<N>``: the rollout worker puts the batch once; the ``--dp`` readers on c each get their balanced share
  (``balanced_shards`` of long-tailed lengths, as ``bench.dataplane_compare``'s ``dp<N>`` row) at once.

Methods: ``ray numpy`` (the worker's ``ray.put`` of numpy arrays, the readers' ``ray.get``: zero-copy on their
node), and refit's ``RayStore`` with and without ``durable`` and ``trust_meta`` (its storage actors on
``--store-host``; the client sent to the worker and the readers once, at setup; the put's meta returned to the
driver and each reader's share of it sent on), and ``transferqueue`` (TransferQueue 0.1.11, SimpleStorage
backend: the worker's ``kv_batch_put`` of a TensorDict, the readers' ``kv_batch_get`` of their keys; the
driver's ``tq.init()`` starts its controller where Ray puts it, and its one storage unit on ``--store-host``
through its own ``backend.SimpleStorage.required_node_resource``; the worker and the readers attach with
``tq.init()`` once, at setup). After each method its clear (refit: and ``settle``, the wait for the durable
copy; TransferQueue: ``kv_clear``) outside the timing; one warm-up round, not timed, also checks the bytes.
Reports each method's median and p90, and its paired ratio to ``ray numpy``: the median over rounds of its time
over ``ray numpy``'s in the same round (p10-p90 of that ratio beside it).

TransferQueue is not in the project's environment (its requirements would downgrade ``packaging`` there and
add ``ray[default]``'s extras), and nothing else it imports is missing from ``.venv``. Install it alone into a
folder of its own, once::

    .venv/bin/uv pip install --no-deps --target /opt/transferqueue-0.1.11 transferqueue==0.1.11

``--tq-path`` (that folder by default) is then put, as a folder holding only its ``transfer_queue`` package,
at the end of ``PYTHONPATH`` for ``ray start`` on every host (so every Ray worker imports it) and for the
driver; the ``.venv`` is not changed. Where it does not import or start (no such folder; ``tq.init()`` failing
or not done within ``--tq-timeout`` seconds), ``transferqueue`` is skipped with the reason printed and kept in
the record (``transferqueue.skipped``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAY_PORT = 6380
HOSTS = ("a", "b", "c")
RESULT = "CLUSTER-DATAPLANE "


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench.cluster_dataplane")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--store-host", default="b", choices=HOSTS, help="where refit's storage actors run")
    ap.add_argument("--object-store-gb", type=float, default=1.5)
    ap.add_argument("--tq-path", default="/opt/transferqueue-0.1.11", help="TransferQueue's install folder")
    ap.add_argument("--tq-timeout", type=float, default=180.0, help="seconds TransferQueue may take to start")
    ap.add_argument("--out", default=None)
    ap.add_argument("--driver", default=None, help=argparse.SUPPRESS)  # the Ray address: run as the driver
    return ap.parse_args(argv)


# -- the driver, inside host a ------------------------------------------------------------------------------------


def _actors(ray, samples: int, seq: int):
    import torch

    from bench.dataplane_compare import FIELDS, _as_dense, make_batch, round_keys

    @ray.remote(num_cpus=0, resources={"host_b": 1})
    class Rollout:
        def __init__(self) -> None:
            self.batch = make_batch(samples, seq)
            self.arrays = {k: v.numpy() for k, v in self.batch.items()}
            self.counter, self.stores = itertools.count(), {}

        def attach(self, stores) -> None:
            self.stores.update(stores)

        def ray_put(self):
            return [ray.put(self.arrays)]  # in a list: the reference travels, not the object

        def refit_put(self, name):
            return self.stores[name].put(round_keys(self.counter, samples), self.batch, partition="bench")

        def tq_attach(self) -> None:
            from tensordict import TensorDict

            self.tq, self.td = _tq_client(), TensorDict(self.batch, batch_size=samples)

        def tq_put(self):
            keys = round_keys(self.counter, samples, "t")
            self.tq.kv_batch_put(keys=keys, partition_id="bench", fields=self.td)
            return keys

    @ray.remote(num_cpus=0, resources={"host_c": 1})
    class Reader:
        def __init__(self) -> None:
            self.stores = {}

        def attach(self, stores) -> None:
            self.stores.update(stores)

        def ray_get(self, holder, rows):
            got = ray.get(holder[0])
            if rows is None:
                return sum(v.size for v in got.values())
            idx = torch.as_tensor(rows)
            return sum(torch.from_numpy(v).index_select(0, idx).numel() for v in got.values())

        def refit_get(self, name, meta):
            return sum(t.numel() for t in self.stores[name].get(meta, select_fields=FIELDS).values())

        def tq_attach(self) -> None:
            self.tq = _tq_client()

        def tq_get(self, keys):
            got = self.tq.kv_batch_get(keys=keys, partition_id="bench", select_fields=FIELDS)
            return sum(_as_dense(v, len(keys)).numel() for v in got.values())

    return Rollout, Reader


def _tq_client():
    """This process's TransferQueue client, attached to the running controller (as a rank attaches)."""
    import transfer_queue as tq

    tq.init()
    return tq


def _methods(ray, stores: dict, rollout, readers: list, shares: list, want: int, tq=None) -> dict:
    """(part, method) -> run(): one put on host b read on host c, returning its clear (outside the timing).
    TransferQueue only where ``tq`` (the driver's, for the clear) is given."""

    def ray_run(dp: bool):
        def run():
            holder = ray.get(rollout.ray_put.remote())
            calls = (
                [r.ray_get.remote(holder, s) for r, s in zip(readers, shares)]
                if dp
                else [readers[0].ray_get.remote(holder, None)]
            )
            assert sum(ray.get(calls)) == want
            return lambda: None

        return run

    def refit_run(name: str, dp: bool):
        store = stores[name]

        def run():
            meta = ray.get(rollout.refit_put.remote(name))
            if dp:
                calls = [r.refit_get.remote(name, meta.select(s)) for r, s in zip(readers, shares)]
            else:
                calls = [readers[0].refit_get.remote(name, meta)]
            assert sum(ray.get(calls)) == want
            return lambda: (store.clear(meta), store.settle())

        return run

    def tq_run(dp: bool):
        def run():
            keys = ray.get(rollout.tq_put.remote())
            if dp:
                calls = [r.tq_get.remote([keys[i] for i in s]) for r, s in zip(readers, shares)]
            else:
                calls = [readers[0].tq_get.remote(keys)]
            assert sum(ray.get(calls)) == want
            return lambda: tq.kv_clear(keys=keys, partition_id="bench")

        return run

    out = {}
    for part, dp in (("put_get", False), (f"dp{len(readers)}", True)):
        out[(part, "ray numpy")] = ray_run(dp)
        out.update({(part, n): refit_run(n, dp) for n in stores})
        if tq is not None:
            out[(part, "transferqueue")] = tq_run(dp)
    return out


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _tq_start(ray, a: argparse.Namespace, actors: list) -> tuple:
    """TransferQueue started from the driver (its storage unit on ``--store-host``) and attached in ``actors``:
    (tq, where its actors run) or (None, the reason it did not start, one line)."""
    import concurrent.futures

    def start():
        import transfer_queue as tq
        from omegaconf import OmegaConf

        store = {"num_data_storage_units": 1, "required_node_resource": f"host_{a.store_host}"}
        tq.init(OmegaConf.create({"backend": {"SimpleStorage": store}}))
        ray.get([x.tq_attach.remote() for x in actors])
        from transfer_queue import interface as tqi

        held = {"controller": tqi._TQ_CONTROLLER, **tqi._TQ_STORAGE["SimpleStorage"]}
        where = dict(zip(held, ray.get([h.__ray_call__.remote(lambda self: _node_ip()) for h in held.values()])))
        return tq, {"version": tq.__version__, "placed": where}

    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        return pool.submit(start).result(timeout=a.tq_timeout)
    except concurrent.futures.TimeoutError:
        return None, f"tq.init() and the actors' attach not done within {a.tq_timeout:.0f} s"
    except Exception as e:  # noqa: BLE001 -- any failure to import or start skips the method, with its reason
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        pool.shutdown(wait=False)


def _rows(times: dict) -> list[dict]:
    from bench.dataplane_compare import pct

    rows = []
    for (part, method), ts in times.items():
        base = times[(part, "ray numpy")]
        paired = [t / b for t, b in zip(ts, base)]
        rows.append(
            {
                "part": part,
                "method": method,
                "median_ms": 1e3 * statistics.median(ts),
                "p90_ms": 1e3 * pct(ts, 90),
                "paired_ratio": statistics.median(paired),
                "paired_p10_p90": [pct(paired, 10), pct(paired, 90)],
                "n": len(ts),
            }
        )
    return rows


def driver(a: argparse.Namespace) -> dict:
    import ray

    from bench.dataplane_compare import dp_shares
    from refit.data import RayStore

    me = os.environ["REFIT_BIND_ADDRESS"]
    ray.init(address=a.driver, _node_ip_address=me, log_to_driver=False)
    opts = {"resources": {f"host_{a.store_host}": 0.01}}
    stores = {
        "refit": RayStore(num_units=1, actor_options=opts),
        "refit durable=False": RayStore(num_units=1, actor_options=opts, durable=False),
        "refit trust_meta": RayStore(num_units=1, actor_options=opts, trust_meta=True),
        "refit durable=False trust_meta": RayStore(num_units=1, actor_options=opts, durable=False, trust_meta=True),
    }
    Rollout, Reader = _actors(ray, a.samples, a.seq)
    rollout, readers = Rollout.remote(), [Reader.remote() for _ in range(a.dp)]
    ray.get([x.attach.remote(stores) for x in [rollout, *readers]])
    nodes = {n["NodeManagerAddress"]: sorted(k for k in n["Resources"] if k.startswith("host_")) for n in ray.nodes()}
    tq, tq_info = _tq_start(ray, a, [rollout, *readers])
    if tq is None:
        print(f"transferqueue skipped: {tq_info}", file=sys.stderr, flush=True)
        tq_info = {"skipped": tq_info}
    want = 2 * a.samples * a.seq
    methods = _methods(ray, stores, rollout, readers, dp_shares(a.samples, a.seq, a.dp), want, tq)
    for run in methods.values():  # warm-up (and the bytes checked, as in every round)
        run()()
    rng = random.Random(a.seed)
    times: dict = {m: [] for m in methods}
    for _ in range(a.rounds):
        order = list(methods)
        rng.shuffle(order)
        for m in order:
            t0 = time.perf_counter()
            done = methods[m]()
            times[m].append(time.perf_counter() - t0)
            done()
            time.sleep(0.05)  # Ray frees the released object in the background: not the next method's cost
    if tq is not None:
        tq.close()
    return {"nodes": nodes, "transferqueue": tq_info, "bytes": 12 * a.samples * a.seq, "rows": _rows(times)}


# -- the cluster, from this machine -------------------------------------------------------------------------------


def _ray_start(cluster, host: str, a: argparse.Namespace, head: str, env: dict, temp: str) -> None:
    ray = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
    here = cluster.host(host).address
    argv = [
        ray,
        "start",
        f"--node-ip-address={here}",
        "--num-cpus=1",
        f"--resources={json.dumps({f'host_{host}': 100})}",
        f"--object-store-memory={int(a.object_store_gb * 2**30)}",
        "--disable-usage-stats",
    ]
    if host == "a":
        argv += ["--head", f"--port={RAY_PORT}", "--include-dashboard=false", f"--temp-dir={temp}"]
    else:
        argv += [f"--address={head}"]
    p = cluster.spawn(host, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = p.communicate(timeout=300)
    if p.returncode != 0:
        raise RuntimeError(f"`ray start` on host {host} failed ({p.returncode}):\n{out[-3000:]}")


def _tq_pythonpath(tq_path: str, temp: str) -> dict:
    """``PYTHONPATH`` ending in a folder of ``temp`` holding only TransferQueue's package (a link to the one in
    ``tq_path``, whose other top-level folders, ``tests`` among them, must not shadow anything); {} without it."""
    package = Path(tq_path) / "transfer_queue"
    if not tq_path or not (package / "__init__.py").is_file():
        print(f"transferqueue: no {package}/__init__.py (see this bench's docstring)", file=sys.stderr, flush=True)
        return {}
    folder = Path(temp) / "tq-pythonpath"
    folder.mkdir()
    (folder / "transfer_queue").symlink_to(package.resolve())
    return {"PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), str(folder)) if p)}


def _run(a: argparse.Namespace, argv: list[str] | None, temp: str) -> str:
    """The cluster up, Ray started on each host, the driver run on host a; its output. Everything torn down."""
    from refit.tools.cluster import Cluster, LinkShape, parse_rate

    with Cluster(list(HOSTS), LinkShape(parse_rate(a.rate))) as cluster:
        head = f"{cluster.host('a').address}:{RAY_PORT}"
        env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}  # Ray's own, across its nodes
        env |= _tq_pythonpath(a.tq_path, temp)
        for h in HOSTS:
            _ray_start(cluster, h, a, head, env, temp)
        me = [sys.executable, "-m", "bench.cluster_dataplane", *(argv or sys.argv[1:]), "--driver", head]
        p = cluster.spawn("a", me, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = p.communicate(timeout=3600)
        if p.returncode != 0:
            raise RuntimeError(f"the driver on host a failed ({p.returncode}):\n{err[-4000:]}")
        return out


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    if a.driver:
        print(RESULT + json.dumps(driver(a)), flush=True)
        return
    # Ray's files in a folder of this run's (a plain ``ray.init()`` elsewhere must not find this cluster), removed after
    temp = tempfile.mkdtemp(prefix="rcr-", dir="/tmp")
    try:
        out = _run(a, argv, temp)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    line = next(x for x in out.splitlines() if x.startswith(RESULT))
    result = {"rate": a.rate, "samples": a.samples, "seq": a.seq, "dp": a.dp, "rounds": a.rounds}
    result |= {"store_host": a.store_host, **json.loads(line[len(RESULT) :])}
    result |= {"date": time.strftime("%Y-%m-%d %H:%M"), "load_avg_after": os.getloadavg()}
    if "skipped" in result["transferqueue"]:
        print(f"transferqueue skipped: {result['transferqueue']['skipped']}", flush=True)
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
