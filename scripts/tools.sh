#!/usr/bin/env bash
# Make sure the Debian programs some tests drive are installed:
#   chromium + chromium-driver  the admin in a real browser (tests/e2e/test_admin_browser.py)
#   pgbouncer                   LISTEN/NOTIFY behind a transaction pooler (tests/integration/test_pgbouncer.py)
#   prometheus (promtool)       the alert rules and dashboard queries in deploy/ (tests/unit/test_deploy_kit.py)
#   openssl, redis-server,      the topologies of tests/integration/test_topologies.py: servers of the
#   rabbitmq-server             test's own (Redis Sentinel and TLS, RabbitMQ TLS), with certificates it makes
set -u

missing() {
  command -v chromium >/dev/null 2>&1 || echo chromium
  command -v chromedriver >/dev/null 2>&1 || echo chromium-driver
  command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] || echo pgbouncer
  command -v promtool >/dev/null 2>&1 || echo prometheus
  command -v openssl >/dev/null 2>&1 || echo openssl
  command -v redis-server >/dev/null 2>&1 || echo redis-server
  command -v rabbitmq-server >/dev/null 2>&1 || [ -x /usr/sbin/rabbitmq-server ] || echo rabbitmq-server
}

packages=$(missing | tr '\n' ' ')
[ -z "${packages// /}" ] && exit 0

echo "tools: installing $packages" >&2
if [ "$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
  echo "tools: $packages missing and this user cannot run apt-get; install them with: apt-get install $packages" >&2
  exit 1
fi
# shellcheck disable=SC2086
$sudo apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $packages >&2

still=$(missing | tr '\n' ' ')
if [ -n "${still// /}" ]; then
  echo "tools: could not install $still; try: apt-get install $still" >&2
  exit 1
fi
