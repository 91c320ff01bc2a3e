#!/bin/bash
# The NPU image's entrypoint: load the CANN environment (set_env.sh: library and operator paths),
# then run qos-serve with the container's arguments. CANN 9 keeps the toolkit's set_env.sh under
# ascend-toolkit/ and, in newer layouts, under cann/; the first one found is used.
for env_file in /usr/local/Ascend/ascend-toolkit/set_env.sh /usr/local/Ascend/cann/set_env.sh; do
    if [ -f "$env_file" ]; then
        # shellcheck disable=SC1090
        source "$env_file"
        break
    fi
done
exec qos-serve "$@"
