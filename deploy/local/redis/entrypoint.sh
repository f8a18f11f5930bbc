#!/bin/sh
# The public image's redis-server is built with protected mode off: do the same here.
if [ "$1" = redis-server ]; then
    shift
    set -- redis-server --protected-mode no "$@"
fi
exec "$@"
