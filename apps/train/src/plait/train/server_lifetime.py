"""Imported by the rank fork server, first of its preloaded modules: the server dies with the launcher.

:mod:`multiprocessing` keeps its fork server alive while any process it forked is (each holds the
server's keep-alive pipe), so a killed launcher would leave the server and the ranks running. The
server instead asks the kernel for SIGKILL when the launcher dies, as each rank does for the
server; a launcher already gone ends it at once. This module has no other use and nothing else
imports it.
"""

import os

from plait.train.lifecycle import die_with_launcher
from plait.train.rank_server import LAUNCHER_PID_ENV

die_with_launcher(int(os.environ[LAUNCHER_PID_ENV]))
