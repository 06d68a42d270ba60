"""`potluck worker`: lend this PC's cores and memory to a head on the LAN."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from ...engine import (
    DEFAULT_CACHE_QUOTA_MB,
    KEEP_STAGE_S,
    PotluckError,
    PrintableFormatter,
    Worker,
    default_threads,
    measure_profile,
    paths,
    validate,
)
from ..cli import COMMANDS, potluck_version
from .common import cluster_keys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "worker", help=COMMANDS["worker"],
        description="Run on each spare PC: advertise this machine on the LAN and compute the layers a head "
        "(`potluck chat --nodes auto`) sends it. Needs the cluster token ($POTLUCK_TOKEN or --token-file).",
    )
    p.add_argument("--port", type=int, default=5733, help="TCP port (0: any free port; default 5733)")
    p.add_argument("--bind", default="0.0.0.0", help="address to listen on (default: all)")
    p.add_argument(
        "--token-file", type=Path,
        help="file holding the cluster token, mode 0600 (default: $POTLUCK_TOKEN or the saved one)",
    )
    p.add_argument("--token", help=argparse.SUPPRESS)  # visible in `ps`: kept for old scripts, undocumented
    p.add_argument("--cache-dir", type=Path, help="where received slices are kept (by sha256)")
    p.add_argument(
        "--models", type=Path, metavar="DIR",
        help="GGUF files this machine holds: a head splitting one of them (same sha256) sends nothing, "
        "the slice is cut here (each file is hashed once)",
    )
    p.add_argument("-t", "--threads", type=int, default=0, help="CPU threads, at most the cores (default 0: all)")
    p.add_argument(
        "--max-message-mb", type=int, default=256, help="largest message accepted (default 256 MB)"
    )
    p.add_argument(
        "--cache-quota-mb", type=int, default=DEFAULT_CACHE_QUOTA_MB,
        help=f"most disk the received slices may use; least recently used go first (default {DEFAULT_CACHE_QUOTA_MB})",
    )
    p.add_argument(
        "--keep-stage-s", type=float, default=KEEP_STAGE_S, metavar="S",
        help="after its head releases it, an idle stage stays loaded this long, so the next head "
        f"loading the same layers starts at once (0: free it at once; default {KEEP_STAGE_S:g})",
    )
    p.add_argument(
        "--no-zeroconf", action="store_true", help="do not advertise (heads must use --nodes)"
    )
    p.add_argument(
        "--zeroconf-interface",
        action="append",
        help="advertise only on this interface address (repeatable; default: all)",
    )


def run(args: argparse.Namespace) -> int:
    if not args.verbose:  # a worker's log lines (joins, loads, refusals) are its output
        logging.getLogger("potluck").setLevel(logging.INFO)
    for handler in logging.getLogger().handlers:  # a long-running service: when each line happened
        handler.setFormatter(PrintableFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    keys = cluster_keys(args)
    if args.cache_quota_mb < 1:
        raise PotluckError("--cache-quota-mb must be at least 1")
    if not 0 <= args.keep_stage_s <= 7 * 86400:
        raise PotluckError("--keep-stage-s must be 0..604800 seconds")
    if not 1 <= args.max_message_mb <= 4096:
        raise PotluckError("--max-message-mb must be 1..4096")
    threads = validate.threads(args.threads, "--threads") or default_threads()
    profile = measure_profile(threads)
    cache = args.cache_dir or (paths.cache_dir() / "worker")
    if args.models is not None and not args.models.is_dir():
        raise PotluckError(f"--models {args.models}: not a folder; give the folder holding your GGUF files")
    worker = Worker(
        keys,
        profile,
        cache,
        bind=args.bind,
        port=args.port,
        n_threads=args.threads,  # 0: the stage follows the load (engine/core/load_watch.py)
        max_msg_bytes=args.max_message_mb << 20,
        cache_quota_bytes=args.cache_quota_mb << 20,
        potluck_version=potluck_version(),
        models_dir=args.models,
        keep_stage_s=args.keep_stage_s,
    )
    advertiser = None
    if not args.no_zeroconf:
        from ...discovery.lan import Advertiser

        advertiser = Advertiser(
            profile, worker.port, potluck_version(), interfaces=args.zeroconf_interface
        )
        advertiser.start()
    stop_on_sigterm(worker)
    host = args.bind if args.bind not in ("0.0.0.0", "*") else "<this-machine>"
    print(
        f"potluck worker {profile.node_id} listening on {host}:{worker.port} "
        f"({profile.cores} cores, {threads} threads, {profile.free_mb} MB free, speed {profile.speed:g} GB/s)",
        flush=True,
    )
    try:
        worker.serve_forever()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        if advertiser is not None:
            advertiser.close()
    print("potluck worker stopped", file=sys.stderr, flush=True)
    # Nothing is left to free (the stage processes have ended, the sockets are closed): skip the
    # interpreter's teardown of llama.cpp's, numba's and ZeroMQ's modules (1.2-1.5 s measured on a
    # busy 2-core machine), so SIGTERM ends a worker within STOP_DEADLINE_S.
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)


STOP_DEADLINE_S = 1.8  # SIGTERM ends the worker and its stage processes within this, whatever it was doing


def stop_on_sigterm(worker: Worker) -> None:
    """SIGTERM (systemd's stop, ``kill``) ends the worker at once, whatever it is doing: the
    handler raises in the main thread (a flag alone waited for whatever the loop was in: once,
    a write to a full pipe, forever; issue 39 item 9), the loop's ``finally`` closes the stage
    processes (CLOSE_WAIT_S, then killed), and a watchdog kills them and exits if cleaning up
    takes past STOP_DEADLINE_S."""
    stopping = threading.Event()

    def watchdog() -> None:  # still running STOP_DEADLINE_S after SIGTERM (a daemon: gone if we are)
        for pid in worker.child_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        logging.getLogger("potluck").error("the worker did not stop within %.1f s of SIGTERM; ended it",
                                           STOP_DEADLINE_S)
        os._exit(1)

    def on_term(signum: int, frame: object) -> None:
        if stopping.is_set():
            return  # already stopping: a second SIGTERM changes nothing
        stopping.set()
        worker.stop()
        timer = threading.Timer(STOP_DEADLINE_S, watchdog)
        timer.daemon = True
        timer.start()
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
