"""The engine of leased work, written once for every lane.

* :mod:`.loop`: the loop a lane plugs into (:class:`~.loop.Lane`), stop reasons,
  wake-ups, the liveness file, SIGTERM/SIGINT (:func:`~.loop.stop_on_signals`);
* :mod:`.heartbeat`: members' heartbeats and the takeover of a dead member's leases;
* :mod:`.lease`: the lease keeper, renewing while long work runs;
* :mod:`.backoff`: the one backoff, capped exponential with jitter;
* :mod:`.observations`: what a loop tells its observers, and the fan-out;
* :mod:`.deadletters`: the retention of dead letters;
* :mod:`.waiter`: sleeping that a signal or a wake-up ends at once;
* :mod:`.gate`: what a lane may publish now of what it claimed (flow control).

The decision vocabulary (done, retry at T, dead-letter, release, hold) is
:mod:`celery_outbox.outcomes`, below the stores, so that they speak it too.
"""
