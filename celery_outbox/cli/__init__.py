"""``manage.py outbox``: one grammar, ``outbox <lane> <verb>``, for every lane of work.

:mod:`.grammar` builds the parser and runs what it parsed; :mod:`.selectors` and
:mod:`.options` hold the flags every lane shares; one module per lane (:mod:`.tasks`,
:mod:`.ordering`, :mod:`.handlers`, :mod:`.events`) and the processes (:mod:`.relay`)
parse, build a request and call the lane's operation. :mod:`.runner` builds the relay
process: the lane, handed its app and its observers.
"""
