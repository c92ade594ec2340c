"""A healing rank of a sharded replica group takes its own shard (gc_strategy/sync/fault_tolerance/shards.py):
checked on two gloo ranks sharding a model with FSDP2."""

import io

import torch
from ft_worker import batch, model, shard

from gc_strategy.sync.fault_tolerance.shards import Shards, parameter_shards
from gc_strategy.tools.ranks import run_ranks


def _step(net: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = batch(rank, step)
    (net(x) - y).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _heal_a_fresh_replica(rank: int, world_size: int) -> dict:
    """A trained sharded model and optimizer sent through :class:`Shards` to a fresh one (never
    stepped: no optimizer state) on the same rank; both then take the same step."""
    nets = [model(), model()]
    for net in nets:
        shard(net, (1, world_size))
    optimizers = [torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9) for net in nets]
    for step in range(3):
        _step(nets[0], optimizers[0], rank, step)
    sent = {"module": Shards(nets[0]).state_dict(), "optimizer": Shards(optimizers[0]).state_dict()}
    wire = io.BytesIO()
    torch.save(sent, wire)  # as torchft's transport sends it: what arrives shares no memory with the sender
    sent = torch.load(io.BytesIO(wire.getvalue()))
    Shards(nets[1]).load_state_dict(sent["module"])
    Shards(optimizers[1]).load_state_dict(sent["optimizer"])
    for net, optimizer in zip(nets, optimizers):
        _step(net, optimizer, rank, 3)
    params = [{n: p.to_local().clone() for n, p in net.named_parameters()} for net in nets]
    full = {n: p.shape.numel() for n, p in nets[0].named_parameters()}
    tensors = [t for t in sent["module"].values()] + [
        t for state in sent["optimizer"]["state"].values() for t in state.values()
    ]
    return {
        "params": params,
        "full": full,
        "sent": sent["module"],
        "plain": all(type(t) is torch.Tensor for t in tensors),
    }


def test_a_sharded_state_travels_as_each_ranks_shard_and_heals_a_fresh_replica_exactly():
    """Each rank sends plain tensors of its own shard (the two ranks' shares add up to each whole
    parameter), and a fresh replica that loads them, its optimizer state
    included, takes the next step to the same parameters, to the bit."""
    results = run_ranks(_heal_a_fresh_replica, 2)
    for result in results:
        assert result["plain"]
        trained, healed = result["params"]
        assert trained.keys() == healed.keys()
        assert all(torch.equal(trained[n], healed[n]) for n in trained)
    for name, numel in results[0]["full"].items():
        shares = [r["sent"][name].numel() for r in results]
        assert sum(shares) == numel and max(shares) < numel


class _RootOwned(torch.nn.Module):
    """The worker's model with a parameter of the root's own (as a GPT's embeddings are): FSDP2
    keeps the root's parameters gathered after a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.scale = model(), torch.nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.scale[:3].sum()


def _parameters_after_an_evaluation(rank: int, world_size: int) -> dict:
    """The root-owned model sharded by FSDP2, a step, then a forward without gradients (an
    evaluation: the root's parameters stay gathered); :func:`parameter_shards` then, and each
    parameter's local shard as FSDP2 holds it."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    root = _RootOwned()
    mesh = shard(root.net, (1, world_size))
    fully_shard(root, mesh=mesh["shard"])
    optimizer = torch.optim.SGD(root.parameters(), lr=0.05)
    _step(root, optimizer, rank, 0)
    with torch.no_grad():
        root(batch(rank, 1)[0])
    gathered = root.scale.shape == (4,) and not isinstance(root.scale, DTensor)
    shards = {n: t.clone() for n, t in parameter_shards(root).items()}
    held = {n: p.to_local().clone() for n, p in root.named_parameters()}
    root.state_dict()  # FSDP2 reshards before it: the storage it frees must still be resizable
    return {"gathered": gathered, "shards": shards, "held": held}


def test_the_parameters_groups_compare_are_each_ranks_shards_after_an_evaluation_too():
    """After a forward without gradients FSDP2 holds the root's parameters whole; what a group
    reports as its replicated parameters (and hashes) is still this rank's shard of each."""
    for result in run_ranks(_parameters_after_an_evaluation, 2):
        assert result["gathered"]  # the case at hand: the root's parameter whole after the forward
        assert result["shards"].keys() == result["held"].keys()
        for name, held in result["held"].items():
            assert torch.equal(result["shards"][name], held), name
        assert result["shards"]["scale"].numel() == 2  # half of the root's 4
