#!/usr/bin/env bash
# Make sure Debian's chromium and chromium-driver are installed: the browser test of
# the admin (tests/e2e/test_admin_browser.py) drives them through Selenium.
set -u

have() { command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; }

if have; then exit 0; fi

echo "browser: installing chromium and chromium-driver" >&2
if [ "$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
  echo "browser: chromium/chromedriver are missing and this user cannot run apt-get;" \
       "install them with: apt-get install chromium chromium-driver" >&2
  exit 1
fi
$sudo apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium chromium-driver >&2

if ! have; then
  echo "browser: could not install chromium and chromium-driver" \
       "(needed by tests/e2e/test_admin_browser.py); try: apt-get install chromium chromium-driver" >&2
  exit 1
fi
