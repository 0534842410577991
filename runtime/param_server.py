"""Parameter-server data parallelism (Plan.ps, Plan.ps_staleness): DistBelief's and GeePS's
form of data parallelism, for jobs where a straggling or slower worker would hold every
all-reduce back.

The job's last `ps` ranks are servers, the first dp ranks workers. Each server owns a share
of the trained parameters (whole tensors, spread by size: `assign`) and steps them with the
user's optimizer, built from the factory over that share. A worker runs its graph without
the gradient all-reduce, pushes each server the gradients of its share (one message:
[step, loss, gradients as fp32]) and copies the server's reply ([version, the share's
parameters as fp32]) into its parameters. Messages go point to point over a gloo group of
the whole job, from host buffers, so a server waits for whichever worker comes first
(gloo's receive from any source). Version v of a share is its parameters after v updates;
update t is step t's.

Synchronous (ps_staleness=0): update t is applied once every worker pushed step t: the sum
of their Partial gradients (the dp graph's, whose sum over the workers is the batch's
gradient), in worker order; the reply comes after it, so step t reads version t on every
worker, as all-reduce dp (and one process on the whole batch) does.

Asynchronous (ps_staleness = k > 0), on each server (backup workers, Chen et al. 2016, with
SSP's bound on staleness, Ho et al. 2013):
- update t is applied once every worker but one has pushed step t (a worker that skipped
  step t counts): the slowest worker never holds an update back;
- a push of step t is answered once update t is applied, with the newest version: every
  worker's step t reads at least version t, so the gradients in time are fresh;
- the one left out pushes late (its step's update was applied): its gradient joins the
  next update if the version it read is at most k updates older, and is dropped otherwise
  (waiting for it would be synchronous training; applying it whatever its age lets a slow
  worker pull the model back). Either way it reads the newest version and skips to the
  first step no server has applied yet, telling the servers (its pm.step returns None for
  the steps between), so the job ends with its other workers.
Stale gradients cost accuracy: delayed by one or two steps on every gradient, AdamW at a
usual learning rate trains the example GPT 20-180% worse in 200 steps (docs/reference.md);
here only the late worker's are stale.
Each worker runs the graph of its own share of the batch, with no collective (its loss and
gradients are the means over that share, its BatchNorm statistics its own), so nothing
ties it to the other workers' pace. The shares' versions advance independently (as in
DistBelief); a pull (evaluate) after the last step reads every share's last version.
`ps_stats` counts what happened: updates without every worker's gradient of their step
("partial"), late pushes applied and dropped, the largest staleness applied.
"""
from __future__ import annotations

import logging
import math
import os

import torch
import torch.distributed as dist

from fxpar.core import ir
from fxpar.core.errors import CheckpointError, NonFiniteLossError, PlanError
from fxpar.runtime import calls, faults, optim
from fxpar.runtime import checkpoint as rckpt
from fxpar.runtime import dist as rdist

log = logging.getLogger(__name__)

PULL = -1  # a message's step field: "send me the parameters now" (evaluate)
SKIP = -2  # a message's step field: "my next step is <its loss field>" (async)
_PUSH_HEAD = 2  # [step, loss]
_REPLY_HEAD = 1  # [version]


def assign(numels: list[int], servers: int) -> list[int]:
    """The server of each parameter: largest first, each to the least loaded server (ties:
    the lower index), so the shares' bytes differ by at most one tensor's."""
    load = [0] * servers
    owner = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        j = min(range(servers), key=lambda j: (load[j], j))
        owner[i] = j
        load[j] += numels[i]
    return owner


def trained(graph: torch.fx.GraphModule, n_params: int) -> list[bool]:
    """Which parameters the graph gives a gradient (the outputs after the loss)."""
    out = next(n for n in graph.graph.nodes if n.op == "output").args[0]
    return [g is not None for g in out[1:1 + n_params]]


def check_optimizer(optimizer) -> None:
    if isinstance(optimizer, torch.optim.Optimizer):
        raise PlanError(
            "Plan.ps: the servers build the optimizer over the parameters they own, so fxpar "
            "must build it: pass a factory, e.g. `optimizer=lambda ps: torch.optim.AdamW(ps, "
            "lr=1e-3)`, not an instance.")


class _Layout:
    """Server j's share: the parameter indices it owns and their offsets in its messages."""

    def __init__(self, params: list[torch.Tensor], owner: list[int | None], servers: int):
        self.indices = [[i for i, o in enumerate(owner) if o == j] for j in range(servers)]
        self.sizes = [p.numel() for p in params]
        self.numel = [sum(self.sizes[i] for i in ix) for ix in self.indices]

    def pack(self, j: int, tensors, out: torch.Tensor, head: int) -> None:
        off = head
        for i in self.indices[j]:
            t, n = tensors[i], self.sizes[i]
            if t is None:
                out[off:off + n].zero_()
            else:
                out[off:off + n].copy_(t.detach().reshape(-1))
            off += n

    def unpack(self, j: int, buf: torch.Tensor, params, head: int) -> None:
        off = head
        with torch.no_grad():
            for i in self.indices[j]:
                p = params[i]
                p.copy_(buf[off:off + p.numel()].view(p.shape))
                off += p.numel()


def _layout(params, is_trained, servers) -> _Layout:
    numels = [p.numel() if t else 0 for p, t in zip(params, is_trained)]
    owner = assign(numels, servers)
    return _Layout(params, [o if t else None for o, t in zip(owner, is_trained)], servers)


class Worker:
    """A worker rank's side: push this step's gradients, take the servers' parameters."""

    def __init__(self, params: list[torch.Tensor], is_trained: list[bool], servers: list[int],
                 staleness: int, group):
        self.params, self.servers, self.staleness, self.group = params, servers, staleness, group
        self.layout = _layout(params, is_trained, len(servers))
        self.push = [torch.zeros(_PUSH_HEAD + n) for n in self.layout.numel]
        self.reply = [torch.empty(_REPLY_HEAD + n) for n in self.layout.numel]
        self.next_step = 0  # the first step no server has applied yet (async: may jump)
        self.stats = {"pushes": 0, "skipped": 0}

    @property
    def asynchronous(self) -> bool:
        return self.staleness > 0

    def skips(self, step: int) -> bool:
        """Whether step `step` (0-based) was applied without this worker (async only)."""
        if step < self.next_step:
            self.stats["skipped"] += 1
            return True
        return False

    def exchange(self, step: int, grads, loss: torch.Tensor) -> None:
        """Push step `step`'s gradients and loss; wait for the parameters the servers send
        back once step's update is applied (the newest version)."""
        ok = self._send(float(step), grads, float(loss))
        self.stats["pushes"] += 1
        versions = self._receive(ok)
        self.next_step = max(step + 1, min(versions))
        if self.next_step > step + 1:  # applied without this worker: skip them, and say so
            for w in self._send(float(SKIP), None, float(self.next_step)):  # (the servers
                w.wait()  # count on a message about each step from every worker)

    def restart(self, step: int) -> None:
        """After a checkpoint's load: the next step is `step` (0-based)."""
        self.next_step = step

    def pull(self) -> None:
        """Take every share's newest parameters (async: before evaluate, so every worker
        evaluates the servers' model, not the version its last step read)."""
        self._receive(self._send(float(PULL), None, 0.0))

    def _send(self, step: float, grads, loss: float) -> list:
        works = []
        for j, (buf, dst) in enumerate(zip(self.push, self.servers)):
            buf[0], buf[1] = step, loss
            if grads is not None:
                self.layout.pack(j, grads, buf, _PUSH_HEAD)
            works.append(dist.isend(buf, dst, group=self.group))
        return works

    def _receive(self, sends: list) -> list[int]:
        recvs = [dist.irecv(buf, src, group=self.group)
                 for buf, src in zip(self.reply, self.servers)]
        for w in (*sends, *recvs):
            w.wait()
        for j, buf in enumerate(self.reply):
            self.layout.unpack(j, buf, self.params, _REPLY_HEAD)
        return [int(buf[0]) for buf in self.reply]


class Server:
    """A server rank's side: its share of the parameters, their optimizer, the pushes that
    wait for their update and the workers that wait for a reply."""

    def __init__(self, share: list[torch.Tensor], factory, index: int, workers: list[int],
                 staleness: int, group):
        self.params, self.index, self.workers = share, index, workers
        self.staleness, self.group = staleness, group
        self.optimizer = optim.build(factory, share) if share else None
        n = sum(p.numel() for p in share)
        self.inbox = torch.empty(_PUSH_HEAD + n)
        self.outbox = torch.empty(_REPLY_HEAD + n)
        self._packed = -1  # the version outbox holds
        self.version = 0
        # update -> [(worker, step, gradients, loss)] pushed for it
        self.pending: dict[int, list[tuple[int, int, torch.Tensor, float]]] = {}
        self.last_pushed = {w: -1 for w in workers}
        self.waiting: dict[int, int] = {}  # worker -> the step it pushed (PULL: a pull)
        self.read = {w: 0 for w in workers}  # worker -> the version it last received
        self.sends: list = []
        self.losses: dict[int, float | None] = {}
        self.pulls = 0
        self.stats = {"updates": 0, "partial": 0, "late": 0, "dropped": 0, "max_staleness": 0}

    def restart(self, step: int) -> None:
        """After a checkpoint's load: `step` updates were applied, every worker is past them."""
        self.version, self._packed = step, -1
        self.pending.clear()
        self.last_pushed = {w: step - 1 for w in self.workers}
        self.read = {w: step for w in self.workers}

    def serve(self, done) -> None:
        """Receive pushes and pulls (from whichever worker sends first), apply the updates
        they make ready and reply to whoever may have an answer, until `done()`."""
        self._reply()
        while not done():
            self.handle(dist.recv(self.inbox, src=None, group=self.group), self.inbox)
        self._wait_sends()

    def handle(self, w: int, msg: torch.Tensor) -> None:
        """One message from worker rank `w`: take it, apply the updates it made ready, reply
        to every worker that may now have an answer."""
        self._take(w, msg)
        while self._ready(self.version):
            self._apply(self.version)
        self._reply()

    def _take(self, w: int, msg: torch.Tensor) -> None:
        step = int(msg[0])
        if step == PULL:
            self.waiting[w] = PULL
            return
        if step == SKIP:  # its next step: the ones before it were applied without it
            self.last_pushed[w] = max(self.last_pushed[w], int(msg[1]) - 1)
            return
        if not math.isfinite(float(msg[1])):  # the worker raises it too
            raise NonFiniteLossError(
                f"step {step + 1}: worker rank {w} pushed a non-finite loss ({float(msg[1])}); "
                "the update was not applied. Usual causes: a too large learning rate, bad "
                "input data, a log/div of zero in the loss.")
        self.last_pushed[w] = step
        self.waiting[w] = step
        into = max(step, self.version)  # a late push (async) joins the next update
        stale = into - self.read[w]
        if stale > self.staleness:  # (only a late one can be: the replies keep the rest in)
            self.stats["dropped"] += 1
            return
        self.stats["late"] += into > step
        self.pending.setdefault(into, []).append((w, step, msg[_PUSH_HEAD:].clone(),
                                                  float(msg[1])))
        self.stats["max_staleness"] = max(self.stats["max_staleness"], stale)

    def _ready(self, t: int) -> bool:
        """Update t: every worker's step t in (sync), every worker's but one (async)."""
        pushed = sum(s >= t for s in self.last_pushed.values())
        return pushed >= (len(self.workers) if not self.staleness else
                          max(1, len(self.workers) - 1))

    def step_done(self, t: int) -> bool:
        """Update t applied and every worker past step t (its push or skip received): a
        server's pm.step returns then, leaving no worker waiting on it."""
        return self.version > t and all(s >= t for s in self.last_pushed.values())

    def _apply(self, t: int) -> None:
        got = sorted(self.pending.pop(t, []), key=lambda x: x[:2])  # (worker order)
        if got and self.optimizer is not None:
            g = got[0][2]
            for x in got[1:]:
                g.add_(x[2])
            if self.staleness:
                g.div_(len(got))
            g = g.to(self.params[0].device)  # (the messages are in host memory)
            grads, off = [], 0
            for p in self.params:
                grads.append(g[off:off + p.numel()].view(p.shape))
                off += p.numel()
            self._wait_sends()  # (the optimizer changes what the outbox was packed from:
            optim.apply_gradients(self.optimizer, self.params, grads)  # packed at reply)
        self.losses[t] = sum(x[3] for x in got) / len(got) if got else None
        self.stats["updates"] += 1
        self.stats["partial"] += sum(x[1] == t for x in got) < len(self.workers)
        self.version += 1

    def _reply(self) -> None:
        for w, step in list(self.waiting.items()):
            if step != PULL and self.version <= step:
                continue
            if self._packed != self.version:
                self._wait_sends()
                self.outbox[0] = self.version
                off = _REPLY_HEAD
                for p in self.params:
                    self.outbox[off:off + p.numel()].copy_(p.detach().reshape(-1))
                    off += p.numel()
                self._packed = self.version
            self.sends.append(dist.isend(self.outbox, w, group=self.group))
            self.read[w] = self.version
            self.pulls += step == PULL
            del self.waiting[w]

    def _wait_sends(self) -> None:
        for w in self.sends:
            w.wait()
        self.sends = []


class ServerRank:
    """What fxpar.parallelize returns on a server rank: the same loop as a worker's runs it
    (`pm.step(batch)` serves one update, `pm.evaluate(batch)` answers the workers' pulls);
    the batch is not read. A server holds its share of the parameters, not the model."""

    def __init__(self, model, world, program: ir.Program, optimizer, workers: list[int],
                 group, weights=None):
        plan = self.plan = program.plan
        self.program, self.world = program, world
        self._call_id = calls.register(rdist.timeout())  # (every rank builds one)
        check_optimizer(optimizer)
        sig = program.signature
        named = dict(model.named_parameters(remove_duplicate=False))
        params = [named[n] for n in sig.param_names]
        is_trained = [t and p.requires_grad for t, p in
                      zip(trained(program.graph, len(params)), params)]
        self.index = world.rank - len(workers)
        layout = _layout(params, is_trained, plan.ps)
        self.param_names = [sig.param_names[i] for i in layout.indices[self.index]]
        with torch.no_grad():  # this server's share, on its device; the rest is never used
            if weights is None:
                share = [named[n].detach().to(world.device, copy=True) for n in self.param_names]
            else:  # a meta-device model / weights=PATH: read only the share
                share = [self._read(weights, n, named[n], world.device) for n in self.param_names]
                weights.release()
        for p in share:
            p.requires_grad_()
        self.server = Server(share, optimizer or (lambda ps: torch.optim.SGD(ps, lr=1e-3)),
                             self.index, workers, plan.ps_staleness, group)
        self.optimizer = self.server.optimizer
        self.step_count = 0
        self.compile_times = list(program.compile_times)

    @staticmethod
    def _read(weights, name: str, like: torch.Tensor, device) -> torch.Tensor:
        """Parameter `name` whole from `weights` (runtime/weights.ModelWeights)."""
        src, key = weights.locate(name)
        return src.read(key, (...,)).to(device=device, dtype=like.dtype, copy=True)

    @property
    def ps_stats(self) -> dict:
        """Updates applied, those without every worker's gradient of their step ("partial"),
        late pushes applied and dropped (read a version more than ps_staleness updates old),
        the largest staleness applied (update minus the version its gradient read)."""
        return dict(self.server.stats)

    def step(self, batch=None) -> torch.Tensor | None:
        """Serve until this server's update of step `step_count` is applied; its mean loss
        over the workers that pushed it (None if none did)."""
        t = self.step_count
        with faults.step_context(self.world, t + 1):
            if not self.server.staleness:
                calls.agree(self._call_id, "step", raw_errors=True)
            self.server.serve(lambda: self.server.step_done(t))
        self.step_count = t + 1
        loss = self.server.losses.pop(t, None)
        return None if loss is None else torch.tensor(loss)

    @calls.collective
    def evaluate(self, batch=None) -> None:
        """Answer every worker's pull (asynchronous: they evaluate the servers' newest
        parameters); a server has no loss to return."""
        self._serve_pulls()
        return None

    @calls.collective
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The workers' call (they return the whole model's): this server's share."""
        self._serve_pulls()
        return self.state_dict()

    @calls.collective
    def whole_tensors(self) -> dict[str, torch.Tensor]:
        """The workers' call (they return every tensor whole): this server's share."""
        self._serve_pulls()
        return self.state_dict()

    @calls.collective
    def full_params(self) -> dict:
        """The workers' call (their weights are whole: nothing to gather)."""
        return {}

    def _serve_pulls(self) -> None:
        """Asynchronous: answer one pull of every worker (they read the servers' newest
        parameters first)."""
        if self.server.staleness:
            target = self.server.pulls + len(self.server.workers)
            self.server.serve(lambda: self.server.pulls >= target)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This server's share of the parameters (names as the model's), copies."""
        return {n: p.detach().clone() for n, p in zip(self.param_names, self.server.params)}

    @calls.collective
    def trace(self, path: str) -> None:
        """The workers' call: rank 0 writes their timelines (a server records none)."""
        dist.all_gather_object([None] * dist.get_world_size(), [])
        return None

    @calls.collective
    def save(self, path: str, extra: dict | None = None) -> str:
        """The workers' call: this server writes its share's optimizer state."""
        self._serve_pulls()
        return save(self, path, extra)

    @calls.collective
    def load(self, path: str, allow_changed_settings: bool = False) -> dict:
        """The workers' call: this server reads its share's parameters and optimizer state."""
        return load(self, path, allow_changed_settings)

    def __getattr__(self, name):
        if name in UNSUPPORTED:
            raise PlanError(UNSUPPORTED[name])
        raise AttributeError(name)

    def __repr__(self):
        return (f"ServerRank(server {self.index} of {self.plan.ps}, "
                f"{len(self.param_names)} parameters, plan={self.plan})")


_NOT_YET = ("Plan.ps (parameter servers): pm.{} is not supported yet: the parameters and the "
            "optimizer state live on the servers in shares. Save the weights from a worker: "
            "`state = pm.full_state_dict()` on every rank (the workers return the servers' "
            "newest parameters), then torch.save(state, path) on rank 0.")
UNSUPPORTED = {m: _NOT_YET.format(m) for m in ("save_pretrained",)}


# --- checkpoints: runtime/checkpoint.py's format, written by workers and servers ------------
# The workers write the model (whole on each: DCP writes one copy), each server its share's
# optimizer state by parameter name, so the checkpoint loads under any plan, and any
# checkpoint (a dp or ZeRO run's) loads here.

def save(pm, path: str, extra: dict | None = None) -> str:
    """pm: a worker's ParallelModel or a ServerRank (every rank calls it; async workers have
    pulled the servers' newest parameters)."""
    path = rckpt.begin_save(path)
    server = isinstance(pm, ServerRank)
    tensors = {} if server else {f"model.{k}": v.detach()
                                 for k, v in _plain_state(pm, path).items()}
    groups, other = [], {}
    if server and pm.optimizer is not None:
        opt, names = pm.optimizer, dict(zip(map(id, pm.server.params), pm.param_names))
        for p, st in opt.state.items():
            for key, v in st.items():
                if isinstance(v, torch.Tensor):
                    tensors[f"optim.state.{names[id(p)]}.{key}"] = v.detach()
                else:
                    other.setdefault(names[id(p)], {})[key] = rckpt._json_only(
                        v, f"optimizer state {key}")
        for gi, g in enumerate(opt.param_groups):
            groups.append({"hyper": {k: rckpt._json_only(
                v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v,
                f"optimizer param_groups[{gi}][{k!r}]") for k, v in g.items() if k != "params"},
                "params": [names[id(p)] for p in g["params"]]})
    tensors.update(rckpt._rng_state(pm))
    extra_enc = rckpt._encode(dict(extra or {}), "extra", tensors, "extra")
    return rckpt.write(path, tensors, {"param_groups": groups, "other": other, "optimizer":
                                       type(pm.optimizer).__name__ if server and pm.optimizer
                                       is not None else None},
                       pm.plan, int(pm.step_count), None, extra_enc)


def load(pm, path: str, allow_changed_settings: bool = False) -> dict:
    """Restore `save`'s (or any fxpar checkpoint's) model, optimizer state, step counter and
    RNG: a worker its whole model, a server its share."""
    meta, reader, md = rckpt.read_meta(path)
    rckpt.check_settings(pm, meta, path, allow_changed_settings)
    server = isinstance(pm, ServerRank)
    want = dict(zip(pm.param_names, pm.server.params)) if server else _plain_state(pm, path)
    rckpt.check_entries(path, md, meta, {k: v.shape for k, v in want.items()}, pm.optimizer)
    okeys = {n: rckpt._state_keys(md, n) for n in want} if server else {}
    rank = dist.get_rank()
    src = rank if rank < meta["world_size"] else rank % meta["world_size"]
    rng = [k for k in (f"rng.cpu.{src}",) if k in md]
    keys = [f"model.{k}" for k in want] + [f"optim.state.{n}.{s}" for n, ss in okeys.items()
                                           for s in ss]
    got = rckpt.read_tensors(path, reader, md, keys + rng +
                             rckpt._tensor_keys(meta.get("extra")), True)
    with torch.no_grad():
        for k, v in want.items():
            v.copy_(got[f"model.{k}"])
    if server and pm.optimizer is not None:
        _load_server_optimizer(pm, okeys, got, meta)
    pm.step_count = int(meta["step_count"])
    (pm.server if server else pm.ps).restart(pm.step_count)
    for k in rng:
        torch.set_rng_state(got[k])
    return rckpt._decode(meta.get("extra") or {}, got)


def _plain_state(pm, path) -> dict[str, torch.Tensor]:
    """A worker's model.state_dict() (its tensors: whole on every worker)."""
    if not pm.state_is_plain():
        raise CheckpointError(
            f"checkpoint {os.fspath(path)!r}: this model's state_dict is made by its own hooks; "
            "Plan.ps saves and loads only models whose state_dict entries are their "
            "parameters and buffers. Save pm.full_state_dict() on rank 0 instead.")
    return pm.model.state_dict(keep_vars=True)


def _load_server_optimizer(pm, okeys: dict, got: dict, meta: dict) -> None:
    opt, names = pm.optimizer, dict(zip(map(id, pm.server.params), pm.param_names))
    index = {id(t): i for i, t in enumerate(t for g in opt.param_groups for t in g["params"])}
    state = {}
    for p in pm.server.params:
        n = names[id(p)]
        entry = {k: got[f"optim.state.{n}.{k}"].to(p.device) for k in okeys[n]}
        entry.update({k: rckpt._decode(v, {}) for k, v in
                      meta.get("optim_other", {}).get(n, {}).items()})
        if entry:
            state[index[id(p)]] = entry
    saved = {n: g["hyper"] for g in meta.get("param_groups", []) for n in g["params"]}
    groups = [rckpt.restored_group(g, next((saved[names[id(p)]] for p in g["params"]
                                            if names[id(p)] in saved), None),
                                   [index[id(p)] for p in g["params"]])
              for g in opt.param_groups]
    opt.load_state_dict({"state": state, "param_groups": groups})
