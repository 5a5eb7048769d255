"""Several worker processes on shared listening sockets (``workers`` > 1; design.md §8), one
module per job, as Postfix's ``master_*.c``:

- :mod:`~relay.supervision.supervisor`: the :class:`Supervisor` (``supervise``): binds
  ``listen`` (and ``tls_listen``) once, starts worker 0 alone (a start-up error is reported
  once, by it, with its exit code 69 or 78) and the others when it serves, forwards SIGTERM
  and SIGINT and waits for the workers' graceful shutdown (up to ``shutdown_grace`` + 5 s for
  replies to final dots + 4 store timeouts + 10 s, then SIGKILL);
- :mod:`~relay.supervision.loop`: the event loop of every relay process (uvloop or asyncio's);
- :mod:`~relay.supervision.spawn`: starting a worker process (its spec in the environment,
  its settings over a pipe, SIGHUP blocked until its handler is set) and waiting for its exit;
- :mod:`~relay.supervision.worker`: the worker process's entry, which imports none of the
  supervisor's side;
- :mod:`~relay.supervision.status`: the status pipe (``serving``, ``reloaded``, ``reload
  failed``), written by a worker, read by the supervisor;
- :mod:`~relay.supervision.slots`: a worker slot, the supervisor's record of one worker;
- :mod:`~relay.supervision.policy`: the restart policy (back-off from 0.5 s doubling to 30 s,
  reset after a minute of serving; giving up after 5 failed starts or a start error);
- :mod:`~relay.supervision.reloads`: SIGHUP read and checked once, forwarded to every worker,
  confirmed, logged and counted once;
- :mod:`~relay.supervision.servers`: the servers it hosts, ``/metrics`` (every worker's),
  ``/healthz``, ``/readyz`` and the console;
- :mod:`~relay.supervision.readiness`: ``/readyz`` over the workers, seeing the supervisor
  through a Protocol.

Every worker inherits the same sockets (one accept queue per listener: a worker that dies
strands no queued connection) and runs its own event loop, store client and upstream pool
(:class:`relay.app.Relay` on :class:`relay.listen.Inherited` sockets). Every worker pays the settle
journal at each of its starts (worker 0 first) and appends what it owes when it becomes owed
(the journal's lock keeps them from losing each other's lines). The package's internal
layers are an import contract in pyproject.toml. Its modules log as ``relay.supervisor``.
"""
