"""``refit demo``: train a tiny HF model on the trainer ranks, refit after every step, compare logits.

Trainer: with a pure ``tp=N`` spec the model really runs tensor-parallel
(``parallelize_module`` over the trainer group) and its source layout is read
from the live DTensor parameters. Other specs (pp, fsdp, dp) run a full replica
on every trainer rank and hand refit only the slices the spec assigns to the
rank, so the transfer is the same as a real trainer's.
Engine: each replica builds the model with different random weights and
receives its shards. With engine tp=1 refit writes straight into the live
parameters; with tp>1 the replica gathers its shards to check them.
The check: the trainer's weights (gathered) and each engine replica's run the
same plain forward on a fixed prompt; max |delta logit| must be exactly 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from refit.config import TransferConfig
from refit.layout import ModelLayout, box_slices
from refit.layout.models import build_model, load_config, param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import ParallelSpec
from refit.plan import ProcessMap, build_plan
from refit.tools.launch import World, run_local
from refit.tools.resources import check_memory
from refit.transfer import Receiver, Sender

PROMPT_LEN = 16


def _prompt(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (1, PROMPT_LEN), generator=g)


def _batch(vocab: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 + step)
    return torch.randint(0, vocab, (2, 32), generator=g)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids.to(next(model.parameters()).device)).logits.float().cpu()


def _engine_groups(world: World, dst: ParallelSpec) -> list:
    """One process group per engine replica (its TP ranks); every process creates all of them."""
    tp = dst.degree("tp")
    groups = []
    for d in range(dst.degree("dp")):
        ranks = [world.n_src + d * tp + t for t in range(tp)]
        groups.append(dist.new_group(ranks))
    return groups


def _trainer(
    world: World, model_name: str, src: ParallelSpec, dst_layout: ModelLayout, steps: int, cfg: TransferConfig, procs
):
    from refit.trainers.dtensor import full_state, layout_from_module, local_shards
    from refit.trainers.hf_tp import parallelize_tp, sync_head_local_grads

    config = load_config(model_name)
    model = build_model(config, torch.float32, device=world.device, seed=0)
    real_tp = src.world_size == src.degree("tp") and src.degree("tp") > 1
    if real_tp:
        parallelize_tp(model, world.trainer_group, world.device.type)
        src_layout = layout_from_module(model, world.n_src)
        tensors = local_shards(model)
    else:
        src_layout = layout_from_spec(param_shapes(model_name, torch.float32), src)
        params = dict(model.named_parameters())
        tensors = {t.name: params[t.name].data[box_slices(box)] for t, box in src_layout.local_tensors(world.src_rank)}
    sender = Sender(src_layout, dst_layout, world.rank, tensors, procs=procs, config=cfg, device=world.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    reference = build_model(config, torch.float32, device=world.device, seed=None) if world.rank == 0 else None
    prompt = _prompt(config.vocab_size)
    rows = []
    for step in range(1, steps + 1):
        ids = _batch(config.vocab_size, step).to(world.device)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        if real_tp:
            sync_head_local_grads(model, world.trainer_group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        full = full_state(model) if real_tp else None
        stats = sender.push(step)
        if world.rank == 0:
            if real_tp:
                reference.load_state_dict(full, strict=True)
                logits = _logits(reference, prompt)
            else:
                logits = _logits(model, prompt)
            rows.append((step, float(out.loss.detach().float().cpu()), logits, stats.seconds))
    return {"rows": rows, "source_layout": "live DTensor parameters" if real_tp else "spec slices of full replicas"}


def _engine(
    world: World, model_name: str, dst: ParallelSpec, src_layout, dst_layout: ModelLayout, steps, cfg, procs, groups
):
    config = load_config(model_name)
    model = build_model(config, torch.float32, device=world.device, seed=1000 + world.dst_rank)
    r = world.dst_rank
    tp = dst.degree("tp")
    params = dict(model.named_parameters())
    if tp == 1:
        tensors = {t.name: params[t.name].data for t, _ in dst_layout.local_tensors(r)}
    else:
        tensors = {
            t.name: torch.empty(tuple(b - a for a, b in box), dtype=t.dtype, device=world.device)
            for t, box in dst_layout.local_tensors(r)
        }
    receiver = Receiver(src_layout, dst_layout, world.rank, tensors, procs=procs, config=cfg, device=world.device)
    prompt = _prompt(config.vocab_size)
    replica, tp_rank = divmod(r, tp)
    rows = []
    for step in range(1, steps + 1):
        stats = receiver.pull(step)
        if tp > 1:  # gather this replica's shards to check them (not part of the refit)
            shards = [None] * tp
            dist.all_gather_object(shards, {k: v.cpu() for k, v in tensors.items()}, group=groups[replica])
            with torch.no_grad():
                for t in dst_layout:
                    for k in range(tp):
                        box = t.box(replica * tp + k)
                        params[t.name].data[box_slices(box)] = shards[k][t.name].to(world.device)
        logits = _logits(model, prompt) if tp_rank == 0 else None
        rows.append((step, logits, stats.seconds))
    return {"replica": replica if tp_rank == 0 else None, "rows": rows}


def _demo_worker(world: World, model_name: str, src: ParallelSpec, dst: ParallelSpec, steps: int, cfg: TransferConfig):
    shapes = param_shapes(model_name, torch.float32)
    dst_layout = layout_from_spec(shapes, dst)
    src_layout = layout_from_spec(shapes, src)
    procs = ProcessMap.disjoint(src.world_size, dst.world_size)
    groups = _engine_groups(world, dst)
    if world.src_rank is not None:
        return _trainer(world, model_name, src, dst_layout, steps, cfg, procs)
    return _engine(world, model_name, dst, src_layout, dst_layout, steps, cfg, procs, groups)


def run_demo(model_name: str, src: ParallelSpec, dst: ParallelSpec, steps: int, cfg: TransferConfig, console) -> bool:
    """Run the demo (module docstring) on this machine, printing one row per step to
    ``console``; True when every step's logits match exactly. The specs must fit the model
    (``rules.check_spec_fits``: the CLI checks them); ``ConfigError`` before any process starts if
    the processes' models cannot fit in this machine's memory (each builds the whole float32
    model, process 0 a second one to check the trainer's logits)."""
    from rich.table import Table

    shapes = param_shapes(model_name, torch.float32)
    plan = build_plan(
        layout_from_spec(shapes, src),
        layout_from_spec(shapes, dst),
        config=cfg,
    )
    n = src.world_size + dst.world_size
    check_memory((n + 1) * plan.dst_layout.nbytes, f"demo on {n} processes")
    console.print(
        f"refit demo: {model_name} ({len(shapes)} tensors, {plan.dst_layout.nbytes / 1e6:.1f} MB float32), "
        f"trainer {src} -> engine {dst}, {steps} steps; plan {plan.digest}, moved/needed={plan.ratio:.2f}"
    )
    results = run_local(_demo_worker, src.world_size, dst.world_size, model_name, src, dst, steps, cfg)
    trainer = results[0]
    engines = [res for res in results[src.world_size :] if res["replica"] is not None]
    console.print(f"trainer layout from {trainer['source_layout']}; {len(engines)} engine replica(s)")
    table = Table("step", "version", "bytes moved", "refit s", "max |delta logit|", "train loss")
    ok = True
    for i, (step, loss, ref_logits, _) in enumerate(trainer["rows"]):
        delta = max((res["rows"][i][1] - ref_logits).abs().max().item() for res in engines)
        seconds = max(res["rows"][i][2] for res in results[src.world_size :])
        ok &= delta == 0.0
        table.add_row(str(step), str(step), f"{plan.bytes_moved:,}", f"{seconds:.4f}", f"{delta:.3g}", f"{loss:.4f}")
    console.print(table)
    return ok
