#!/usr/bin/env bash
# A collaboration of emulated hosts on one Linux machine, one network namespace per host.
#
#   <prefix>sw   the switch: one port per host, named after the host (bb, p1, p2, ...), joined by
#                a kernel bridge (br0), or by deploy/impair.py (--shaper user, see below)
#   <prefix>bb   the backbone, <subnet>.1, eth0 (a veth to the switch), not shaped
#   <prefix>pI   peer I, <subnet>.(I+1), eth0, shaped on both ends of its veth: eth0 (its upload)
#                and port pI in <prefix>sw (its download) each get the peer's rate, one-way delay
#                and loss, so its RTT to the backbone is twice the delay.
#   <prefix>rI   peer I's NAT router, only with --nat pI=KIND: eth0 on the switch (port pI) with
#                <subnet>.(I+1), lan0 10.200.I.1 towards the peer, whose eth0 then has 10.200.I.2
#                (default route via the router). IPv4 forwarding on (IPv6 is not forwarded), and
#                iptables in the router's namespace: MASQUERADE out of eth0, and a stateful
#                FORWARD chain (policy DROP; lan0 -> eth0 accepted, eth0 -> lan0 only for
#                established or related connections), as a home router without port forwards.
#                KIND eim: plain MASQUERADE, which keeps the peer's source port unless it is
#                taken (endpoint-independent mapping in practice); symmetric: MASQUERADE
#                --random-fully, a random port for every connection (a new one per destination).
#                The shaping of a NATed peer is on the router's eth0 (its upload) and its port on
#                the switch (its download): the router-switch link is the home's uplink; the
#                peer-router link is not shaped. The peer announces the router's outside address
#                (<subnet>.(I+1), port 4001), where nothing is forwarded to it: dial-backs fail
#                (new inbound TCP to the router is dropped, not reset, as home routers do; a
#                hole punch between two eim peers then gets through, a symmetric one does not).
#
# Shapers: netem puts rate, delay and loss in one qdisc on each end. A kernel without sch_netem
# gets `user` instead (--shaper auto): tbf on each end for the rate, and in place of the bridge a
# user-space switch, deploy/impair.py, on AF_PACKET sockets, which holds each frame for the delay
# of its ingress and egress ports and drops it with their loss probabilities (seeded, --seed).
# The hosts' eth0 then run without checksum and segmentation offloads (the switch reads frames as
# the veth hands them over). `--shaper tbf` applies the rate only (said in `<run dir>/state`).
# Nothing is created in the root namespace (NAT rules live in the routers' namespaces); a unique
# --prefix keeps concurrent testbeds apart. Needs root, iproute2 (ip, tc), iptables for --nat,
# and the peertrain checkout this script lives in.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PREFIX=${TESTBED_PREFIX:-pt-}
SUBNET=${TESTBED_SUBNET:-10.77.0.0/24}
SHAPES=${TESTBED_SHAPES:-"100mbit,5ms,0% 20mbit,40ms,0.5% 10mbit,80ms,1%"}
SHAPER=${TESTBED_SHAPER:-auto}
SEED=${TESTBED_SEED:-0}
RUN_DIR=${TESTBED_RUN_DIR:-}
MAX_STEPS=${TESTBED_MAX_STEPS:-10}
TIMEOUT=${TESTBED_TIMEOUT:-600}
NAT=${TESTBED_NAT:-}
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x $ROOT/.venv/bin/python ]]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
BACKBONE_PORT=31337
PEER_PORT=4001

usage() {
    cat <<EOF
Usage: deploy/testbed.sh [options] COMMAND [args]

A peertrain collaboration of emulated hosts on one Linux machine: a backbone and N peers, each in
its own network namespace, joined by veth pairs to a switch, each peer's link shaped with tc
(netem), or with tc (tbf, rate) and a user-space switch that adds delay and loss (deploy/impair.py).

Commands:
  up N             create namespaces <prefix>sw, <prefix>bb and <prefix>p1..pN, links, shaping
                   (and <prefix>rI, the NAT router of each peer I named in --nat)
  start            start the backbone and the N peers (they train until --max-steps), wait for
                   every peer to join
  wait             wait until every peer has finished training (or --timeout), print a summary;
                   exit 0 if all finished
  status [ARGS]    run \`peer status ARGS\` from the backbone's namespace (e.g. status --json)
  down             stop every process started (by PID, then whatever is left in the
                   namespaces), delete the namespaces; idempotent
  run N            up N, start, wait, then down (always, also on failure or Ctrl+C)

Options (environment variable in brackets):
  --prefix P       namespace prefix [TESTBED_PREFIX, default pt-]
  --run-dir DIR    logs, PIDs, keys, checkpoints [TESTBED_RUN_DIR, default /tmp/<prefix>testbed]
  --subnet NET     an IPv4 /24 [TESTBED_SUBNET, default 10.77.0.0/24]; backbone .1, peer I .(I+1)
  --shapes LIST    per-peer "RATE,DELAY,LOSS" entries, space-separated, peer I takes entry I
                   (cycling), "-" leaves a peer unshaped
                   [TESTBED_SHAPES, default "100mbit,5ms,0% 20mbit,40ms,0.5% 10mbit,80ms,1%"]
  --shaper S       netem, user (tbf for the rate; delay and loss in deploy/impair.py, a
                   user-space switch in place of the bridge), tbf (rate only) or auto
                   [TESTBED_SHAPER, default auto: netem if the kernel has it, else user]
  --seed N         the user switch's loss RNG seed [TESTBED_SEED, default 0]
  --nat LIST       put peers behind their own NAT router: entries pI=KIND separated by commas
                   or spaces, KIND eim (MASQUERADE: keeps the source port, endpoint-independent)
                   or symmetric (MASQUERADE --random-fully: a new port per connection), e.g.
                   "p1=eim,p2=symmetric" [TESTBED_NAT, default none]. Router <prefix>rI holds
                   <subnet>.(I+1) outside and 10.200.I.1 inside, the peer 10.200.I.2; nothing
                   is forwarded inwards; shaping is on the router's outside link. Needs iptables.
  --max-steps S    global step the peers stop at, 0 for none [TESTBED_MAX_STEPS, default 10]
  --timeout SEC    longest wait for training [TESTBED_TIMEOUT, default 600]
  -h, --help       this help

Processes run with \$PYTHON (default: .venv/bin/python of the checkout, else python3) and the
config file \$PEERTRAIN_CONFIG (default configs/debug.toml), with small-batch defaults for any
PEERTRAIN_* variable not already set (see peer_env in this script); logs go to the run dir
(bb.out/bb.log, pI.out/pI.log; *.log are JSON lines); the user switch's PID is in switch.pid,
its output (statistics at \`down\`, or on SIGUSR1) in sw.out.
EOF
}

say() { echo "testbed: $*" >&2; }
die() {
    say "$*"
    exit 1
}

# --- names and state ------------------------------------------------------------------------

ns() { echo "${PREFIX}$1"; }
host_ip() { # host_ip bb | pI
    local base=${SUBNET%.*}
    if [[ $1 == bb ]]; then echo "$base.1"; else echo "$base.$((${1#p} + 1))"; fi
}
hosts() { # bb p1 .. pN
    local n=$1 i
    echo bb
    for ((i = 1; i <= n; i++)); do echo "p$i"; done
}

# Namespaces of this prefix that exist now: exactly <prefix>(sw|bb|pN|rN), never a longer
# prefix's.
our_namespaces() {
    local name rest
    ip netns list 2>/dev/null | while read -r name _; do
        [[ $name == "$PREFIX"* ]] || continue
        rest=${name#"$PREFIX"}
        if [[ $rest =~ ^(sw|bb|[pr][0-9]+)$ ]]; then echo "$name"; fi
    done
}

# The NAT kind of host pI (eim or symmetric), or nothing: from --nat.
nat_of() {
    local entry
    for entry in ${NAT//,/ }; do
        if [[ ${entry%%=*} == "$1" ]]; then echo "${entry#*=}"; fi
    done
}
lan_ip() { echo "10.200.${1#p}.$2"; } # lan_ip pI 1|2: peer I's router inside, the peer

state_get() { if [[ -f $RUN_DIR/state ]]; then sed -n "s/^$1=//p" "$RUN_DIR/state" | tail -n 1; fi; }

shape_of() { # the "RATE,DELAY,LOSS" entry of peer I, or -
    local i=$1 entries
    read -r -a entries <<<"$SHAPES"
    ((${#entries[@]} > 0)) || {
        echo -
        return
    }
    echo "${entries[$(((i - 1) % ${#entries[@]}))]}"
}

check_options() {
    [[ $PREFIX =~ ^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}$ ]] ||
        die "--prefix $PREFIX: expected up to 32 letters, digits, '.', '_' or '-'"
    [[ $SUBNET =~ ^([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})\.0/24$ ]] ||
        die "--subnet $SUBNET: expected an IPv4 /24 such as 10.77.0.0/24"
    [[ $SHAPER =~ ^(auto|netem|tbf|user)$ ]] ||
        die "--shaper $SHAPER: expected auto, netem, user or tbf"
    [[ $SEED =~ ^[0-9]+$ ]] || die "--seed $SEED: expected a whole number"
    [[ $MAX_STEPS =~ ^[0-9]+$ ]] || die "--max-steps $MAX_STEPS: expected a whole number"
    [[ $TIMEOUT =~ ^[0-9]+$ ]] || die "--timeout $TIMEOUT: expected whole seconds"
    local entry
    for entry in $SHAPES; do
        [[ $entry == - || $entry =~ ^[0-9.]+[kmg]?bit,[0-9.]+(us|ms|s),[0-9.]+%$ ]] ||
            die "--shapes entry $entry: expected RATE,DELAY,LOSS like 20mbit,40ms,0.5% (or -)"
    done
    local seen=" "
    for entry in ${NAT//,/ }; do
        [[ $entry =~ ^p([1-9][0-9]*)=(eim|symmetric)$ ]] ||
            die "--nat entry $entry: expected pI=eim or pI=symmetric, like p1=eim"
        [[ $seen != *" ${entry%%=*} "* ]] || die "--nat names ${entry%%=*} twice"
        seen+="${entry%%=*} "
    done
    # The routers' inside networks are 10.200.I.0/24: the switch's subnet must not be one.
    if [[ -n ${NAT//[, ]/} && $SUBNET == 10.200.* ]]; then
        die "--subnet $SUBNET: with --nat, not in 10.200.0.0/16 (the NATed peers' networks)"
    fi
    RUN_DIR=${RUN_DIR:-${TMPDIR:-/tmp}/${PREFIX}testbed}
}

need_root() {
    [[ $EUID -eq 0 ]] || die "$1 needs root (network namespaces and tc)"
    command -v ip >/dev/null && command -v tc >/dev/null || die "$1 needs iproute2 (ip and tc)"
}

# --- up -------------------------------------------------------------------------------------

netem_available() { # probe on the switch namespace's loopback
    if tc -n "$(ns sw)" qdisc add dev lo root netem delay 1ms 2>/dev/null; then
        tc -n "$(ns sw)" qdisc del dev lo root
        return 0
    fi
    return 1
}

# shape NAMESPACE DEVICE RATE DELAY LOSS: the egress of DEVICE.
shape() {
    local namespace=$1 dev=$2 rate=$3 delay=$4 loss=$5
    if [[ $SHAPER == netem ]]; then
        tc -n "$namespace" qdisc add dev "$dev" root netem limit 10000 \
            delay "$delay" loss "$loss" rate "$rate"
    else
        # Bucket: Mbit/2 KB (4 ms at the rate), 32 KB at least, as tests/test_shaped_link.py
        # uses (peers measured within 15 % of the rate there).
        local mbit=${rate%bit}
        case $mbit in
        *g) mbit=$(awk "BEGIN { print ${mbit%g} * 1000 }") ;;
        *m) mbit=${mbit%m} ;;
        *k) mbit=$(awk "BEGIN { print ${mbit%k} / 1000 }") ;;
        *) mbit=$(awk "BEGIN { print $mbit / 1000000 }") ;;
        esac
        local burst
        burst=$(awk "BEGIN { b = $mbit / 2; print (b < 32 ? 32 : int(b)) }")
        tc -n "$namespace" qdisc add dev "$dev" root tbf rate "$rate" burst "${burst}kb" \
            latency 100ms
    fi
}

cmd_up() {
    local n=${1:-}
    [[ $n =~ ^[0-9]+$ ]] && ((n >= 1 && n <= 200)) || die "up N: N must be 1..200 peers"
    need_root up
    [[ -z $(our_namespaces) ]] || die "namespaces with prefix $PREFIX exist; run down first"
    local entry natted
    for entry in ${NAT//,/ }; do
        natted=${entry%%=*}
        ((${natted#p} <= n)) || die "--nat $entry: there are only $n peers"
    done
    if [[ -n ${NAT//[, ]/} ]]; then
        command -v iptables >/dev/null || die "--nat needs iptables"
    fi
    mkdir -p "$RUN_DIR"
    # A fresh run: earlier logs and checkpoints go (keys stay, so peer ids do too).
    rm -rf "$RUN_DIR"/{state,pids,switch.pid,backbone,*.out,*.log,*.checkpoints}
    : >"$RUN_DIR/pids"
    # A failure half-way tears down what was made (under `run`, its own trap does).
    local own_trap=0
    if [[ -z $(trap -p EXIT) ]]; then
        own_trap=1
        trap 'say "up failed; tearing down"; cmd_down' EXIT
    fi

    local sw host i entry rate delay loss kind edge where ports=()
    sw=$(ns sw)
    ip netns add "$sw"
    ip -n "$sw" link set dev lo up
    if [[ $SHAPER == auto ]]; then
        if netem_available; then SHAPER=netem; else
            SHAPER=user
            say "this kernel has no sch_netem: rate with tbf, delay and loss in a user-space" \
                "switch (deploy/impair.py)"
        fi
    elif [[ $SHAPER == netem ]] && ! netem_available; then
        die "--shaper netem: this kernel has no sch_netem (try --shaper user)"
    fi
    {
        echo "prefix=$PREFIX"
        echo "peers=$n"
        echo "subnet=$SUBNET"
        echo "shaper=$SHAPER"
        echo "nat=${NAT//,/ }"
    } >"$RUN_DIR/state"
    if [[ $SHAPER == user ]]; then
        # The switch's ports carry no addresses: no IPv6 link-local ones either, so the namespace
        # sends nothing of its own into the collaboration.
        ip netns exec "$sw" sh -c 'echo 1 >/proc/sys/net/ipv6/conf/default/disable_ipv6' ||
            true
    else
        ip -n "$sw" link add br0 type bridge
        ip -n "$sw" link set dev br0 up
    fi

    for host in $(hosts "$n"); do
        ip netns add "$(ns "$host")"
        ip -n "$(ns "$host")" link set dev lo up
        # edge: the namespace whose eth0 is on the switch, the host's own or its NAT router's.
        kind=$(nat_of "$host")
        if [[ -n $kind ]]; then
            edge=$(ns "r${host#p}")
            up_router "$host" "$kind"
            where="$(host_ip "$host") via $kind NAT ($host at $(lan_ip "$host" 2))"
        else
            edge=$(ns "$host")
            where=$(host_ip "$host")
        fi
        # Both ends are created inside namespaces: nothing touches the root namespace.
        ip -n "$edge" link add eth0 type veth peer name "$host" netns "$sw"
        # Under the user switch the port is in no bridge: the kernel must not switch it too.
        if [[ $SHAPER != user ]]; then ip -n "$sw" link set dev "$host" master br0; fi
        ip -n "$sw" link set dev "$host" up
        ip -n "$edge" addr add "$(host_ip "$host")/24" dev eth0
        ip -n "$edge" link set dev eth0 up
        if [[ $SHAPER == user ]]; then
            # The veth would hand the switch's packet sockets frames with partial checksums and
            # 64 KB TCP segments (GSO), which it could not send on: software does both instead
            # (a router segments and checksums what it forwards from its peer then, too).
            (cd "$ROOT" && ip netns exec "$edge" "$PYTHON" deploy/impair.py \
                offloads-off eth0) || die "$host: could not turn off eth0's offloads"
        fi
        if [[ $host == bb ]]; then
            echo "bb=$where unshaped" >>"$RUN_DIR/state"
            ports+=(bb)
            continue
        fi
        i=${host#p}
        entry=$(shape_of "$i")
        if [[ $entry == - ]]; then
            echo "$host=$where unshaped" >>"$RUN_DIR/state"
            ports+=("$host")
            continue
        fi
        IFS=, read -r rate delay loss <<<"$entry"
        ports+=("$host=$delay,$loss")
        shape "$edge" eth0 "$rate" "$delay" "$loss" # its upload
        shape "$sw" "$host" "$rate" "$delay" "$loss" # its download
        case $SHAPER in
        netem) echo "$host=$where rate $rate delay $delay loss $loss" ;;
        user) echo "$host=$where rate $rate delay $delay loss $loss (user switch)" ;;
        *) echo "$host=$where rate $rate (delay $delay, loss $loss not applied)" ;;
        esac >>"$RUN_DIR/state"
    done
    if [[ $SHAPER == user ]]; then start_switch "${ports[@]}"; fi
    if ((own_trap)); then trap - EXIT; fi
    say "up: $n peers, shaper $SHAPER, run dir $RUN_DIR"
    grep -E '^(bb|p[0-9]+)=' "$RUN_DIR/state" | sed 's/^/  /' >&2
}

# up_router pI KIND: peer I's NAT router <prefix>rI and the link between them (the router's eth0,
# towards the switch, is made by the caller as a host's would be). The peer gets 10.200.I.2 and
# a default route via the router's 10.200.I.1. The router forwards IPv4 only (a NATed peer has no
# IPv6 path out, nor in), masquerades what leaves eth0 (KIND eim: keeping the source port where
# it is free; symmetric: --random-fully, a random port per connection, so a new one per
# destination), and forwards inwards only what belongs to a connection from inside: no port is
# forwarded, so connections from outside to the router's or the peer's address fail (dropped).
up_router() {
    local host=$1 kind=$2 router random=()
    router=$(ns "r${host#p}")
    ip netns add "$router"
    ip -n "$router" link set dev lo up
    ip -n "$(ns "$host")" link add eth0 type veth peer name lan0 netns "$router"
    ip -n "$(ns "$host")" addr add "$(lan_ip "$host" 2)/24" dev eth0
    ip -n "$(ns "$host")" link set dev eth0 up
    ip -n "$(ns "$host")" route add default via "$(lan_ip "$host" 1)"
    ip -n "$router" addr add "$(lan_ip "$host" 1)/24" dev lan0
    ip -n "$router" link set dev lan0 up
    # Per namespace: this turns IPv4 forwarding on in the router only (IPv6 stays off, said
    # explicitly where the kernel has IPv6).
    ip netns exec "$router" sh -c 'echo 1 >/proc/sys/net/ipv4/ip_forward
        f=/proc/sys/net/ipv6/conf/all/forwarding; if [ -w $f ]; then echo 0 >$f; fi'
    if [[ $kind == symmetric ]]; then random=(--random-fully); fi
    local rules=(
        "-t nat -A POSTROUTING -o eth0 -j MASQUERADE ${random[*]}"
        "-P FORWARD DROP"
        "-A FORWARD -i lan0 -o eth0 -j ACCEPT"
        "-A FORWARD -i eth0 -o lan0 -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT"
        # A home router drops what nobody inside asked for instead of answering with a reset:
        # with a reset, the first SYN of a hole punch (arriving before the other side's own SYN
        # has opened its NAT) would tear down the mapping the punch needs.
        "-A INPUT -i eth0 -p tcp -m conntrack --ctstate NEW -j DROP"
    )
    local rule
    for rule in "${rules[@]}"; do
        # shellcheck disable=SC2086 # a rule's words
        ip netns exec "$router" iptables -w 10 $rule || die "$host: iptables $rule failed"
    done
}

# start_switch PORT...: deploy/impair.py in the switch namespace, its PID in switch.pid; waits
# until it has bound every port.
start_switch() {
    local pid t
    (cd "$ROOT" && exec ip netns exec "$(ns sw)" "$PYTHON" deploy/impair.py --seed "$SEED" "$@" \
        </dev/null >"$RUN_DIR/sw.out" 2>&1) &
    pid=$!
    echo "$pid" >"$RUN_DIR/switch.pid"
    for ((t = 0; t < 100; t++)); do
        if grep -q '^impair: switching ' "$RUN_DIR/sw.out" 2>/dev/null; then return 0; fi
        alive "$pid" || break
        sleep 0.1
    done
    say "the user switch did not start; $RUN_DIR/sw.out says:"
    tail -n 20 "$RUN_DIR/sw.out" >&2 || true
    die "user switch failed"
}

# --- start ----------------------------------------------------------------------------------

# Defaults for a fast collaboration, each only where the caller's environment has not set it.
peer_env() {
    export PEERTRAIN_CONFIG=${PEERTRAIN_CONFIG:-$ROOT/configs/debug.toml}
    export PEERTRAIN_LOG_FORMAT=${PEERTRAIN_LOG_FORMAT:-json}
    export PEERTRAIN_TASK_MICRO_BATCH=${PEERTRAIN_TASK_MICRO_BATCH:-16}
    export PEERTRAIN_TASK_TARGET_BATCH=${PEERTRAIN_TASK_TARGET_BATCH:-256}
    # 3 s, not less: behind the default shapes' 80 ms links (160 ms RTT) a ticket took up to 1.8 s
    # to be stored, and with a 1 s window the peers missed every gathering of step 1 for 300 s.
    export PEERTRAIN_TRAINING_GATHER_WINDOW=${PEERTRAIN_TRAINING_GATHER_WINDOW:-3.0}
    export PEERTRAIN_TRAINING_PROGRESS_INTERVAL=${PEERTRAIN_TRAINING_PROGRESS_INTERVAL:-0.5}
    export PEERTRAIN_TRAINING_VALIDATION_INTERVAL=${PEERTRAIN_TRAINING_VALIDATION_INTERVAL:-5}
    export PEERTRAIN_TRAINING_MAX_STEPS=$MAX_STEPS
    export PEERTRAIN_MEASURE_PROBE_SECONDS=${PEERTRAIN_MEASURE_PROBE_SECONDS:-1.0}
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    export PYTHONUNBUFFERED=1
}

# launch HOST ARGS...: run `$PYTHON -m ARGS` in HOST's namespace, in the background. `ip netns
# exec` execs the command, so the PID recorded is the Python process's own.
launch() {
    local host=$1
    shift
    (cd "$ROOT" && exec ip netns exec "$(ns "$host")" "$PYTHON" -m "$@" \
        </dev/null >"$RUN_DIR/$host.out" 2>"$RUN_DIR/$host.log") &
    echo "$host $!" >>"$RUN_DIR/pids"
}

alive() { # a running process, not a zombie
    local state
    state=$(awk '{ print $3 }' "/proc/$1/stat" 2>/dev/null) || return 1
    [[ -n $state && $state != Z ]]
}

pid_of() { awk -v h="$1" '$1 == h { p = $2 } END { print p }' "$RUN_DIR/pids" 2>/dev/null || true; }

# wait_for_line HOST TEXT SECONDS: print the first line of HOST.out containing TEXT.
wait_for_line() {
    local host=$1 text=$2 seconds=$3 pid line
    pid=$(pid_of "$host")
    for ((t = 0; t < seconds * 5; t++)); do
        line=$(grep -m 1 -F -- "$text" "$RUN_DIR/$host.out" 2>/dev/null || true)
        if [[ -n $line ]]; then
            echo "$line"
            return 0
        fi
        alive "$pid" || break
        sleep 0.2
    done
    say "$host: no line with '$text' within ${seconds}s; last lines of $RUN_DIR/$host.log:"
    tail -n 20 "$RUN_DIR/$host.log" >&2 || true
    return 1
}

cmd_start() {
    need_root start
    local n bb_ip line addr host ip
    n=$(state_get peers)
    [[ -n $n ]] && grep -qxF "$(ns bb)" <<<"$(our_namespaces)" || die "not up; run up N first"
    if [[ -s $RUN_DIR/pids ]]; then
        while read -r host pid; do
            if alive "$pid"; then die "already started ($host is PID $pid); run down first"; fi
        done <"$RUN_DIR/pids"
    fi
    : >"$RUN_DIR/pids"
    if [[ $(state_get shaper) == user ]] && ! switch_pid >/dev/null; then
        die "the user switch is not running (see $RUN_DIR/sw.out); run down, then up"
    fi
    peer_env
    bb_ip=$(host_ip bb)
    PEERTRAIN_TRAINING_CHECKPOINT_DIR=$RUN_DIR/bb.checkpoints \
        launch bb cli.backbone_cli start --identity "$RUN_DIR/bb.key" \
        --listen /ip4/0.0.0.0/tcp/0 --port "$BACKBONE_PORT" \
        --announce "/ip4/$bb_ip/tcp/$BACKBONE_PORT"
    line=$(wait_for_line bb "peer join --backbone /ip4/$bb_ip/" 60) || die "backbone did not start"
    addr=${line##*--backbone }
    echo "$addr" >"$RUN_DIR/backbone"
    say "backbone $addr"
    for host in $(hosts "$n"); do
        [[ $host == bb ]] && continue
        ip=$(host_ip "$host")
        PEERTRAIN_TRAINING_CHECKPOINT_DIR=$RUN_DIR/$host.checkpoints \
            launch "$host" cli.peer_cli join --backbone "$addr" --identity "$RUN_DIR/$host.key" \
            --listen /ip4/0.0.0.0/tcp/0 --port "$PEER_PORT" --announce "/ip4/$ip/tcp/$PEER_PORT"
    done
    for host in $(hosts "$n"); do
        [[ $host == bb ]] && continue
        line=$(wait_for_line "$host" " joined collaboration" 180) || die "$host did not join"
        say "$host joined at $(host_ip "$host") as $(awk '{ print $2 }' <<<"$line")"
    done
}

# --- wait -----------------------------------------------------------------------------------

finished_step() { # the step a peer's log says it finished at, or nothing
    { grep -o 'training finished at step [0-9]*' "$RUN_DIR/$1.log" 2>/dev/null || true; } |
        tail -n 1 | awk '{ print $NF }'
}

cmd_wait() {
    local n host pid running started failed=0 step
    n=$(state_get peers)
    [[ -n $n && -s $RUN_DIR/pids ]] || die "nothing started; run start first"
    started=$SECONDS
    while :; do
        running=0
        for host in $(hosts "$n"); do
            [[ $host == bb ]] && continue
            if alive "$(pid_of "$host")"; then running=$((running + 1)); fi
        done
        ((running == 0)) && break
        if ((SECONDS - started >= TIMEOUT)); then
            say "wait: $running peers still training after ${TIMEOUT}s"
            break
        fi
        sleep 1
    done
    for host in $(hosts "$n"); do
        [[ $host == bb ]] && continue
        step=$(finished_step "$host")
        if [[ -n $step ]]; then
            echo "$host finished at step $step"
        else
            echo "$host did not finish (see $RUN_DIR/$host.log)"
            failed=1
        fi
    done
    return "$failed"
}

# --- status ---------------------------------------------------------------------------------

cmd_status() {
    need_root status
    [[ -s $RUN_DIR/backbone ]] || die "no backbone started (no $RUN_DIR/backbone); run start first"
    peer_env
    cd "$ROOT"
    ip netns exec "$(ns bb)" "$PYTHON" -m cli.peer_cli status \
        --backbone "$(cat "$RUN_DIR/backbone")" "$@"
}

# --- down -----------------------------------------------------------------------------------

# The user switch's PID while it runs in our switch namespace (a reused PID is someone else's).
switch_pid() {
    local pid
    pid=$(cat "$RUN_DIR/switch.pid" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] && alive "$pid" || return 1
    [[ $(ip netns identify "$pid" 2>/dev/null) == "$(ns sw)" ]] || return 1
    echo "$pid"
}

# stop PID...: SIGTERM, then SIGKILL to whichever still runs after 5 s.
stop() {
    local pids=("$@") left=() pid t
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for ((t = 0; t < 25; t++)); do
        left=()
        for pid in "${pids[@]}"; do if alive "$pid"; then left+=("$pid"); fi; done
        ((${#left[@]} == 0)) && return 0
        sleep 0.2
    done
    kill -KILL "${left[@]}" 2>/dev/null || true
}

# Stop what start launched (SIGTERM: peers withdraw their presence; SIGKILL after 5 s), then the
# user switch (after the peers: they withdraw through it), then anything else still inside our
# namespaces, then delete the namespaces (and their links).
cmd_down() {
    local namespaces pids=() switch inside="" strays=0 host pid name cmdline t
    namespaces=$(our_namespaces)
    switch=$(switch_pid || true)
    if [[ -s $RUN_DIR/pids ]]; then
        while read -r host pid; do
            # Only a PID still in our namespace, or one whose command names our run dir: a PID
            # the kernel reused since is someone else's.
            alive "$pid" || continue
            name=$(ip netns identify "$pid" 2>/dev/null || true)
            cmdline=$(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" || true)
            if [[ $name == "$(ns "$host")" || $cmdline == *"$RUN_DIR/"* ]]; then pids+=("$pid"); fi
        done <"$RUN_DIR/pids"
    fi
    [[ -n $namespaces || ${#pids[@]} -gt 0 || -n $switch ]] || return 0
    need_root down
    if ((${#pids[@]})); then stop "${pids[@]}"; fi
    if [[ -n $switch ]]; then
        stop "$switch"
        pids+=("$switch")
        say "down: user switch $(sed -n 's/^impair: stopped; //p' "$RUN_DIR/sw.out" | tail -n 1)"
    fi
    for name in $namespaces; do # the safety net: whatever else runs in our namespaces
        for ((t = 0; t < 50; t++)); do
            inside=$(ip netns pids "$name" 2>/dev/null | xargs || true)
            [[ -z $inside ]] && break
            # shellcheck disable=SC2086 # a list of PIDs
            kill -KILL $inside 2>/dev/null || true
            strays=$((strays + $(wc -w <<<"$inside")))
            sleep 0.1
        done
        [[ -z $inside ]] || say "down: processes $inside in $name would not die"
    done
    for name in $namespaces; do ip netns del "$name" 2>/dev/null || true; done
    [[ -z $(our_namespaces) ]] || die "down: namespaces left: $(our_namespaces | xargs)"
    say "down: ${#pids[@]} started processes stopped, $strays others killed," \
        "namespaces deleted: $(echo "$namespaces" | xargs)"
}

# --- run ------------------------------------------------------------------------------------

cmd_run() {
    local n=${1:-} began=$SECONDS code=0
    need_root run
    trap 'cmd_down' EXIT
    trap 'exit 130' INT TERM
    cmd_up "$n"
    cmd_start
    cmd_wait || code=$?
    say "run: $((SECONDS - began)) s from up to the end of training"
    return "$code"
}

# --- main -----------------------------------------------------------------------------------

main() {
    local command="" args=()
    while (($#)); do
        case $1 in
        -h | --help)
            usage
            return 0
            ;;
        --prefix | --run-dir | --subnet | --shapes | --shaper | --seed | --nat | --max-steps | --timeout)
            (($# >= 2)) || die "$1 needs a value"
            case $1 in
            --prefix) PREFIX=$2 ;;
            --run-dir) RUN_DIR=$2 ;;
            --subnet) SUBNET=$2 ;;
            --shapes) SHAPES=$2 ;;
            --shaper) SHAPER=$2 ;;
            --seed) SEED=$2 ;;
            --nat) NAT=$2 ;;
            --max-steps) MAX_STEPS=$2 ;;
            --timeout) TIMEOUT=$2 ;;
            esac
            shift 2
            ;;
        --*) if [[ $command == status ]]; then args+=("$1") && shift; else die "unknown option $1 (see --help)"; fi ;;
        *)
            if [[ -z $command ]]; then command=$1; else args+=("$1"); fi
            shift
            ;;
        esac
    done
    check_options
    case $command in
    up) cmd_up "${args[@]}" ;;
    start) cmd_start ;;
    wait) cmd_wait ;;
    status) cmd_status "${args[@]}" ;;
    down) cmd_down ;;
    run) cmd_run "${args[@]}" ;;
    "")
        usage >&2
        return 2
        ;;
    *) die "unknown command $command (see --help)" ;;
    esac
}

main "$@"
