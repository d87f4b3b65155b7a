"""rnnserve's server, one subpackage per place it runs: ``http`` (each HTTP worker), ``codec``
(bodies <-> arrays, in the HTTP workers), ``engine`` (beside the models) and ``ipc`` (the wire
between workers and engine); the modules here (settings, logs, metrics, ``interface``) run in
every process."""
