/*
 * gpufrac's nvidia-smi view: a stand-in for libnvidia-ml.so.1, put first on
 * a fractional container's LD_LIBRARY_PATH by the node agent. Every NVML
 * function is forwarded to the real library (forward.c, generated from
 * nvml.h); the memory-info calls are answered for the container: its hard
 * limit (NVIDIA_GPU_MEMORY_LIMIT, MiB) is the GPU's total memory, and used
 * memory never exceeds it. Without the variable it changes nothing.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include "nvml.h"

static void *real_handle;

/* Paths where container images carry the real library; GPUFRAC_REAL_NVML
 * comes first. The shim's own file is never taken for the real one. */
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

static void *real(void) {
    if (real_handle) return real_handle;
    const char *env = getenv("GPUFRAC_REAL_NVML");
    if (env && *env && !is_self(env)) real_handle = dlopen(env, RTLD_NOW | RTLD_LOCAL);
    for (int i = 0; !real_handle && candidates[i]; i++) {
        if (!is_self(candidates[i])) real_handle = dlopen(candidates[i], RTLD_NOW | RTLD_LOCAL);
    }
    return real_handle;
}

/* gpufrac_real_symbol is what the generated forwarders call. */
void *gpufrac_real_symbol(const char *name) {
    void *h = real();
    return h ? dlsym(h, name) : NULL;
}

/* limit_bytes is the container's hard limit, 0 when none is set. */
static unsigned long long limit_bytes(void) {
    const char *v = getenv("NVIDIA_GPU_MEMORY_LIMIT");
    if (!v || !*v) return 0;
    char *end;
    unsigned long long mib = strtoull(v, &end, 10);
    if (*end != '\0' || mib == 0) return 0;
    return mib << 20;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    nvmlReturn_t (*f)(nvmlDevice_t, nvmlMemory_t *) =
        (nvmlReturn_t (*)(nvmlDevice_t, nvmlMemory_t *))gpufrac_real_symbol("nvmlDeviceGetMemoryInfo");
    if (!f) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t ret = f(device, memory);
    unsigned long long limit = limit_bytes();
    if (ret != NVML_SUCCESS || !limit || !memory) return ret;
    memory->total = limit;
    if (memory->used > limit) memory->used = limit;
    memory->free = limit - memory->used;
    return ret;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    nvmlReturn_t (*f)(nvmlDevice_t, nvmlMemory_v2_t *) =
        (nvmlReturn_t (*)(nvmlDevice_t, nvmlMemory_v2_t *))gpufrac_real_symbol("nvmlDeviceGetMemoryInfo_v2");
    if (!f) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t ret = f(device, memory);
    unsigned long long limit = limit_bytes();
    if (ret != NVML_SUCCESS || !limit || !memory) return ret;
    memory->total = limit;
    memory->reserved = 0; /* the driver's reserve is outside the container's share */
    if (memory->used > limit) memory->used = limit;
    memory->free = limit - memory->used;
    return ret;
}
