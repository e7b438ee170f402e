"""Topic routing on kombu's Redis transport by RabbitMQ's rules.

kombu's virtual transports route a topic exchange with a regular expression made of
each binding key, stored with the binding, and its ``#`` needs at least one word:
``order.#`` misses ``order``, which RabbitMQ routes (before kombu 5.7 its ``*``
also matched several words). Events bound by a pattern would then reach a service
on RabbitMQ and silently not on Redis.

:class:`RabbitTopics` is kombu's own topic exchange type with RabbitMQ's rules
(``*`` one word, ``#`` zero or more): bindings store its expression, and its
lookup matches each binding key itself, so a binding stored by another version
routes the same. :func:`use_rabbit_topics` puts it on a kombu channel; the relay's
Redis publisher and the events' declarations use it.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from kombu.transport.virtual.exchange import TopicExchange

#: Any number of words, each after a dot (RabbitMQ's ``#`` after another word).
_WORDS = r"(?:\.[^.]*)*"


@functools.lru_cache(maxsize=1024)
def topic_expression(binding_key: str) -> re.Pattern[str]:
    """The routing keys RabbitMQ routes to a topic binding of ``binding_key``.

    ``*`` is one word, ``#`` any number of them, zero included (``order.#``
    matches ``order``); a word holds no dot and may be empty.
    """
    return re.compile(f"^(?:{_first(tuple(binding_key.split('.')))})\\Z")


def _first(words: tuple[str, ...]) -> str:
    """The expression for ``words`` where the first word has no dot before it."""
    word, rest = words[0], "".join(_after_dot(w) for w in words[1:])
    if word == "*":
        return "[^.]*" + rest
    if word != "#":
        return re.escape(word) + rest
    # "#" first: one word or more, then the rest; or none, and the rest comes first.
    some = "[^.]*" + _WORDS + rest
    return some if len(words) == 1 else f"{some}|{_first(words[1:])}"


def _after_dot(word: str) -> str:
    if word == "#":
        return _WORDS
    return r"\." + ("[^.]*" if word == "*" else re.escape(word))


class RabbitTopics(TopicExchange):
    """kombu's topic exchange type, routing as RabbitMQ does."""

    def key_to_pattern(self, rkey: str) -> str:
        """The expression stored with a binding (other processes match with it)."""
        return topic_expression(rkey).pattern

    def lookup(
        self, table: Any, exchange: str, routing_key: str, default: Any
    ) -> set[str]:
        """The queues whose binding key matches ``routing_key``, whatever expression
        was stored with the binding."""
        return {
            queue
            for rkey, _, queue in table
            if topic_expression(rkey).match(routing_key)
        }


def use_rabbit_topics(channel: Any) -> None:
    """Route topic exchanges on ``channel`` (a kombu virtual channel) by RabbitMQ's rules.

    Channels of other transports (py-amqp's: the broker routes) are left alone.
    """
    types = getattr(channel, "exchange_types", None)
    if isinstance(types, dict) and not isinstance(types.get("topic"), RabbitTopics):
        types["topic"] = RabbitTopics(channel)
