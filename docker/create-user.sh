#!/bin/sh
# Create the account the image runs as: NAME with UID 1000 (the usual first user on a host, so that
# files in mounted volumes keep a familiar owner). Run by Dockerfile.nvidia.
#
# Ubuntu 24.04 base images (NGC 25.xx) already have user "ubuntu" with UID 1000 and group "ubuntu"
# with GID 1000, where `useradd --uid 1000` fails ("UID 1000 is not unique"). Whoever holds the
# UID is renamed to NAME (home moved to /home/NAME, its own group renamed too); where the UID is
# free (Ubuntu 22.04 bases) NAME is created. Running it again changes nothing.
#
#   create-user.sh NAME [UID]
#   ROOT=DIR create-user.sh NAME [UID]   edit DIR/etc/{passwd,group,shadow,gshadow} instead (tests)
set -eu
name=${1:?usage: create-user.sh NAME [UID]}
uid=${2:-1000}
root=${ROOT:-}

field() { # field FILE KEY_COLUMN KEY VALUE_COLUMN: that column of the first line whose key matches
    awk -F: -v key="$3" -v keycol="$2" -v col="$4" '$keycol == key { print $col; exit }' "$root$1"
}

shadow_tool() { # shadow_tool TOOL ARGS...: with --prefix ROOT when ROOT is set
    tool=$1
    shift
    if [ -n "$root" ]; then
        "$tool" --prefix "$root" "$@"
    else
        "$tool" "$@"
    fi
}

if [ -n "$(field /etc/passwd 1 "$name" 1)" ]; then
    echo "create-user: $name exists (uid $(field /etc/passwd 1 "$name" 3))"
    exit 0
fi
holder=$(field /etc/passwd 3 "$uid" 1)
if [ -n "$holder" ]; then
    group=$(field /etc/group 3 "$(field /etc/passwd 1 "$holder" 4)" 1)
    echo "create-user: uid $uid belongs to $holder: renaming it to $name"
    shadow_tool usermod --login "$name" --home "/home/$name" --move-home --comment "$name" "$holder"
    if [ "$group" = "$holder" ] && [ -z "$(field /etc/group 1 "$name" 1)" ]; then
        shadow_tool groupmod --new-name "$name" "$holder"
    fi
else
    shadow_tool useradd --create-home --uid "$uid" --user-group --shell /bin/bash "$name"
fi
