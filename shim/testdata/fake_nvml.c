/* A fake NVML for the shim's tests: two 80 GiB GPUs, 10 GiB used each. */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
typedef int nvmlReturn_t;
typedef struct { int index; } *nvmlDevice_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
static struct { int index; } devices[2] = {{0}, {1}};

nvmlReturn_t nvmlInit_v2(void) { return 0; }
nvmlReturn_t nvmlShutdown(void) { return 0; }
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *n) { *n = 2; return 0; }
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d) {
    if (i > 1) return 2;
    *d = (nvmlDevice_t)&devices[i];
    return 0;
}
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
    (void)d;
    m->total = 80ULL << 30; m->used = 10ULL << 30; m->free = 70ULL << 30;
    return 0;
}
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m) {
    (void)d;
    m->total = 80ULL << 30; m->reserved = 512ULL << 20; m->used = 10ULL << 30; m->free = m->total - m->reserved - m->used;
    return 0;
}
typedef struct { unsigned int pid; unsigned long long usedGpuMemory; unsigned int gpuInstanceId, computeInstanceId; } nvmlProcessInfo_t;
/* GPU 0 runs the calling process (3 GiB) and a process of another
 * container (5 GiB, a pid that does not exist here); GPU 1 reports none. */
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *n, nvmlProcessInfo_t *infos) {
    if (d->index == 1) { *n = 0; return 0; }
    if (*n < 2) { *n = 2; return 7; }
    infos[0].pid = (unsigned int)getpid(); infos[0].usedGpuMemory = 3ULL << 30;
    infos[1].pid = 0x7ffffffe; infos[1].usedGpuMemory = 5ULL << 30;
    *n = 2;
    return 0;
}
const char *nvmlErrorString(nvmlReturn_t r) { return r ? "fake error" : "fake success"; }

/* What nvidia-smi asks for before anything else: a table of the library's
 * internal entries; this one's first word is a marker the test looks for. */
static const unsigned long long export_table[2] = {0x5eed, 0};
nvmlReturn_t nvmlInternalGetExportTable(const void **table, const void *id) {
    (void)id;
    *table = export_table;
    return 0;
}

/* The driver's per-cgroup limits: FAKE_CGROUP_HARD_MIB on every GPU for the
 * cgroup FAKE_CGROUP names, as a driver holding a resized container to it;
 * any other cgroup has none (NVML_ERROR_NOT_FOUND). */
typedef struct { const char *nameSpace; unsigned long long softLimit, hardLimit, currentUsed; } nvmlGetMemoryLimits_v1_t;
nvmlReturn_t nvmlDeviceGetMemoryLimits_v1(nvmlDevice_t d, nvmlGetMemoryLimits_v1_t *l) {
    const char *cg = getenv("FAKE_CGROUP"), *mib = getenv("FAKE_CGROUP_HARD_MIB");
    (void)d;
    if (!cg || !mib || !l || !l->nameSpace || strcmp(l->nameSpace, cg) != 0) return 6;
    l->softLimit = 0; l->hardLimit = strtoull(mib, NULL, 10) << 20; l->currentUsed = 0;
    return 0;
}
