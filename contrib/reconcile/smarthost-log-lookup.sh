#!/bin/sh
# An example `command` evidence source for dedup-relay's reconciler
# (docs/operating/reconciliation.md): looks one Message-ID up in a Postfix smarthost's mail
# log and prints what it found, in the command protocol:
#
#   accepted <the log line>   the smarthost queued it (qmgr's "(queue active)")
#   refused <the log line>    it refused it at end of data (a "reject:" of that queue id)
#   unknown                   nothing logged for it at or after the attempt
#
# Usage (the relay appends the two arguments):
#   SMARTHOST_LOG=/var/log/mail.log smarthost-log-lookup.sh '<id@example.com>' 1796677481
# The log may be a local file or one fetched over ssh first; SMARTHOST_SKEW (default 2) is how
# many seconds before the attempt a log stamp may be and still be about it. Stamps in either
# syslog form (traditional stamps are read as the current year, by date -d). An unreadable
# log exits 1, which the relay takes as "unknown".
#
#   [[reconcile_source]]
#   name = "smarthost"
#   command = ["/usr/bin/env", "SMARTHOST_LOG=/var/log/mail.log",
#              "/usr/local/lib/dedup-relay/smarthost-log-lookup.sh"]
set -eu

message_id=${1:?usage: smarthost-log-lookup.sh MESSAGE-ID ATTEMPT-UNIX-SECONDS}
attempt=${2:?usage: smarthost-log-lookup.sh MESSAGE-ID ATTEMPT-UNIX-SECONDS}
log=${SMARTHOST_LOG:?set SMARTHOST_LOG to the smarthost\'s mail log}
since=$((attempt - ${SMARTHOST_SKEW:-2}))
[ -r "$log" ] || { echo "cannot read $log" >&2; exit 1; }

# the stamp of a log line as unix seconds: RFC 3339 (one field) or "Mon dd hh:mm:ss" (three)
stamp() {
  case $1 in
    [0-9][0-9][0-9][0-9]-*) date -d "${1%% *}" +%s ;;
    *) date -d "$(printf '%s' "$1" | cut -c1-15)" +%s ;;
  esac
}

# cleanup's "QID: message-id=<...>" lines for this Message-ID, oldest first: the first one
# logged at or after the attempt names the queue id whose fate answers
grep -F -- ": message-id=$message_id" "$log" | while IFS= read -r line; do
  [ "$(stamp "$line")" -ge "$since" ] || continue
  queue_id=$(printf '%s\n' "$line" | sed -n 's/.*: \([0-9A-Za-z]*\): message-id=.*/\1/p')
  fate=$(grep -E -- ": $queue_id: (.*\(queue active\)$|(milter-)?reject: )" "$log" | head -n 1)
  case $fate in
    *"(queue active)") echo "accepted $fate" ;;
    *reject:*) echo "refused $fate" ;;
    *) echo "unknown queue id $queue_id has no verdict yet" ;;
  esac
  exit 0  # leaves the subshell of the pipe: its answer is the script's
done | head -n 1 | grep . || echo unknown
