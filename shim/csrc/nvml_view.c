/*
 * gpufrac's nvidia-smi view: a stand-in for libnvidia-ml.so.1, put first on
 * a fractional container's LD_LIBRARY_PATH by the node agent. Every NVML
 * function is forwarded to the real library (forward.c, generated from
 * nvml.h); the memory-info calls are answered for the container: its hard
 * limit (the driver's for its cgroup, which a resize changes; else
 * NVIDIA_GPU_MEMORY_LIMIT, MiB) is the GPU's total memory, used is
 * what its own processes use (or, when NVML's process IDs are not visible
 * from the container, the GPU's use, capped at the limit). Without a
 * limit it changes nothing.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include "nvml.h"

static void *real_handle;

/* Paths where container images carry the real library; GPUFRAC_REAL_NVML
 * comes first, the directories of LD_LIBRARY_PATH last. The shim's own
 * file is never taken for the real one. */
static const char *const candidates[] = {
    "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
    "/usr/lib64/libnvidia-ml.so.1",
    "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1",
    "/usr/lib/libnvidia-ml.so.1",
    NULL,
};

static int is_self(const char *path) {
    Dl_info self;
    char a[PATH_MAX], b[PATH_MAX];
    if (!dladdr((void *)&is_self, &self) || !self.dli_fname) return 0;
    if (!realpath(path, a) || !realpath(self.dli_fname, b)) return 0;
    return strcmp(a, b) == 0;
}

/* open_in_search_path tries libnvidia-ml.so.1 in each directory of
 * LD_LIBRARY_PATH but the shim's own: where the driver's libraries are not
 * in the system's directories but on the library path (GKE's
 * /usr/local/nvidia/lib64, which its images put on LD_LIBRARY_PATH). A
 * dlopen by bare name would find the shim itself, already loaded. */
static void *open_in_search_path(void) {
    const char *path = getenv("LD_LIBRARY_PATH");
    char file[PATH_MAX];
    while (path && *path) {
        size_t n = strcspn(path, ":");
        if (n > 0 && n + sizeof "/libnvidia-ml.so.1" <= sizeof file) {
            memcpy(file, path, n);
            strcpy(file + n, "/libnvidia-ml.so.1");
            if (!is_self(file) && access(file, R_OK) == 0) {
                void *h = dlopen(file, RTLD_NOW | RTLD_LOCAL);
                if (h) return h;
            }
        }
        path += n;
        if (*path == ':') path++;
    }
    return NULL;
}

static void *real(void) {
    if (real_handle) return real_handle;
    const char *env = getenv("GPUFRAC_REAL_NVML");
    if (env && *env && !is_self(env)) real_handle = dlopen(env, RTLD_NOW | RTLD_LOCAL);
    for (int i = 0; !real_handle && candidates[i]; i++) {
        if (!is_self(candidates[i])) real_handle = dlopen(candidates[i], RTLD_NOW | RTLD_LOCAL);
    }
    if (!real_handle) real_handle = open_in_search_path();
    return real_handle;
}

/* gpufrac_real_symbol is what the generated forwarders call. */
void *gpufrac_real_symbol(const char *name) {
    void *h = real();
    return h ? dlsym(h, name) : NULL;
}

/* env_limit_bytes is the hard limit the container was created with
 * (NVIDIA_GPU_MEMORY_LIMIT, MiB), 0 when none is set. */
static unsigned long long env_limit_bytes(void) {
    const char *v = getenv("NVIDIA_GPU_MEMORY_LIMIT");
    if (!v || !*v) return 0;
    char *end;
    unsigned long long mib = strtoull(v, &end, 10);
    if (*end != '\0' || mib == 0) return 0;
    return mib << 20;
}

/* own_cgroup names this process's cgroup as the driver wants it, the full
 * sysfs path: /sys/fs/cgroup and the path /proc/self/cgroup gives ("/" in
 * a container's own cgroup namespace, whose /sys/fs/cgroup is its cgroup). */
static int own_cgroup(char *path, size_t size) {
    FILE *f = fopen("/proc/self/cgroup", "r");
    char line[4096];
    int found = 0;
    if (!f) return 0;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "0::", 3) == 0) {
            line[strcspn(line, "\n")] = '\0';
            found = snprintf(path, size, "/sys/fs/cgroup%s", line + 3) < (int)size;
            break;
        }
    }
    fclose(f);
    return found;
}

/* limit_bytes is the container's hard limit on device, 0 when none is set:
 * what the driver holds its cgroup to (nvmlDeviceGetMemoryLimits_v1, r615
 * and later), which follows a resize of the running container; else the
 * limit it was created with. */
static unsigned long long limit_bytes(nvmlDevice_t device) {
    nvmlReturn_t (*get)(nvmlDevice_t, nvmlGetMemoryLimits_v1_t *) =
        (nvmlReturn_t (*)(nvmlDevice_t, nvmlGetMemoryLimits_v1_t *))gpufrac_real_symbol("nvmlDeviceGetMemoryLimits_v1");
    char cgroup[4096];
    if (get && own_cgroup(cgroup, sizeof cgroup)) {
        nvmlGetMemoryLimits_v1_t l;
        memset(&l, 0, sizeof l);
        l.nameSpace = cgroup;
        if (get(device, &l) == NVML_SUCCESS && l.hardLimit != 0 && l.hardLimit != NVML_DEVICE_MEMORY_LIMIT_MAX) return l.hardLimit;
    }
    return env_limit_bytes();
}

/* container_used is the memory used on device by the processes this
 * container can see (NVML reports them and /proc/<pid> exists here). It
 * returns 0 when it cannot tell, leaving the caller's value. */
static int container_used(nvmlDevice_t device, unsigned long long *used) {
    nvmlReturn_t (*f)(nvmlDevice_t, unsigned int *, nvmlProcessInfo_t *) =
        (nvmlReturn_t (*)(nvmlDevice_t, unsigned int *, nvmlProcessInfo_t *))gpufrac_real_symbol("nvmlDeviceGetComputeRunningProcesses_v3");
    if (!f) return 0;
    nvmlProcessInfo_t infos[256];
    unsigned int n = sizeof infos / sizeof infos[0];
    if (f(device, &n, infos) != NVML_SUCCESS) return 0;
    int visible = 0;
    unsigned long long sum = 0;
    for (unsigned int i = 0; i < n; i++) {
        char path[32];
        snprintf(path, sizeof path, "/proc/%u", infos[i].pid);
        if (access(path, F_OK) != 0) continue;
        visible = 1;
        if (infos[i].usedGpuMemory != NVML_VALUE_NOT_AVAILABLE) sum += infos[i].usedGpuMemory;
    }
    if (visible) *used = sum;
    return visible;
}

static void as_container(nvmlDevice_t device, unsigned long long limit, unsigned long long *total,
                         unsigned long long *used, unsigned long long *free_) {
    container_used(device, used);
    *total = limit;
    if (*used > limit) *used = limit;
    *free_ = limit - *used;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    nvmlReturn_t (*f)(nvmlDevice_t, nvmlMemory_t *) =
        (nvmlReturn_t (*)(nvmlDevice_t, nvmlMemory_t *))gpufrac_real_symbol("nvmlDeviceGetMemoryInfo");
    if (!f) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t ret = f(device, memory);
    unsigned long long limit = limit_bytes(device);
    if (ret != NVML_SUCCESS || !limit || !memory) return ret;
    as_container(device, limit, &memory->total, &memory->used, &memory->free);
    return ret;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    nvmlReturn_t (*f)(nvmlDevice_t, nvmlMemory_v2_t *) =
        (nvmlReturn_t (*)(nvmlDevice_t, nvmlMemory_v2_t *))gpufrac_real_symbol("nvmlDeviceGetMemoryInfo_v2");
    if (!f) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t ret = f(device, memory);
    unsigned long long limit = limit_bytes(device);
    if (ret != NVML_SUCCESS || !limit || !memory) return ret;
    memory->reserved = 0; /* the driver's reserve is outside the container's share */
    as_container(device, limit, &memory->total, &memory->used, &memory->free);
    return ret;
}

/* nvmlInternalGetExportTable is in no header, but nvidia-smi asks for it to
 * check that it runs against its own driver's NVML: without it, nvidia-smi
 * stops with "Mismatch in versions between nvidia-smi and NVML" (seen on
 * r580, docs/gpu-proof; NVIDIA's own mock NVML in k8s-test-infra implements
 * it for the same reason). Forwarded untouched: the table holds the real
 * library's entries. */
nvmlReturn_t nvmlInternalGetExportTable(const void **table, const void *id) {
    nvmlReturn_t (*f)(const void **, const void *) =
        (nvmlReturn_t (*)(const void **, const void *))gpufrac_real_symbol("nvmlInternalGetExportTable");
    if (!f) return NVML_ERROR_FUNCTION_NOT_FOUND;
    return f(table, id);
}
