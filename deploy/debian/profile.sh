# /etc/profile.d/tsd.sh (tsd package): points TrainStream clients at the system daemon's socket,
# /run/tsd/tsd.sock, which users other than root would not look at by default.
if [ -z "${TSD_SOCKET:-}" ] && [ -S /run/tsd/tsd.sock ]; then
    export TSD_SOCKET=/run/tsd/tsd.sock
fi
