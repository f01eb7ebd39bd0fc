"""moto's server (`python -m moto.server`, same arguments) with requests applied one
at a time.

moto's DynamoDB `TransactWriteItems` is not atomic under concurrent requests: it
deep-copies the table before a transaction and restores that copy when the
transaction is cancelled, undoing (or half-applying) what other threads wrote
meanwhile. Real DynamoDB serializes writes per item and cancels a contended
transaction with `TransactionConflict`; the ledger's concurrency test (96
simultaneous reservations against one cap) needs an emulator that is at least
serializable. Connections are still accepted concurrently; only the application of
each request holds the lock.
"""

import threading

import moto.server as server

_lock = threading.Lock()
_run_simple = server.run_simple


def _serialized(app):
    def serial(environ, start_response):
        with _lock:
            # Consume the body inside the lock: a lazy iterator would escape it.
            return list(app(environ, start_response))

    return serial


def run_simple(host, port, app, **kwargs):
    return _run_simple(host, port, _serialized(app), **kwargs)


server.run_simple = run_simple

if __name__ == "__main__":
    server.main()
