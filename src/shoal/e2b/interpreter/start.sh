#!/bin/sh
# The code-interpreter template's start command (run by the E2B front when the sandbox is created):
# the execute server on 127.0.0.1:49999, reached from outside through the front's port route.
cd "${HOME:-/home/user}" || cd /
exec python3 /opt/shoal/interpreter_server.py --port 49999
