#!/usr/bin/env bash
# Make sure the services the tests need answer on loopback.
# In CI (CI=true) a missing service fails the run; elsewhere we try to start it.
set -u

up() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

start() {
  case "$1" in
    postgresql) pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start ;;
    mariadb) start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd ;;
    redis) redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" \
             --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log ;;
    rabbitmq) rabbitmq-server -detached ;;
  esac
}

failed=0
for pair in postgresql:5432 mariadb:3306 redis:6379 rabbitmq:5672; do
  name=${pair%%:*}; port=${pair##*:}
  if up "$port"; then continue; fi
  if [ "${CI:-}" = "true" ]; then
    echo "services: $name is not answering on 127.0.0.1:$port (CI does not start services)" >&2
    failed=1; continue
  fi
  echo "services: starting $name" >&2
  start "$name" >/dev/null 2>&1 || true
  for _ in $(seq 1 60); do up "$port" && break; sleep 1; done
  if ! up "$port"; then echo "services: could not start $name" >&2; failed=1; fi
done
# RabbitMQ accepts TCP before the app is ready; wait for the AMQP handshake too.
if [ $failed = 0 ] && command -v rabbitmqctl >/dev/null 2>&1; then
  rabbitmqctl await_startup >/dev/null 2>&1 || true
fi
exit $failed
