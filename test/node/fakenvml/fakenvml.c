/*
 * A stand-in for the driver's libnvidia-ml.so.1 on the node test's machine,
 * which has no GPU. It is built against go-nvml's copy of NVIDIA's nvml.h, so
 * every signature and structure is the real library's, and it answers only
 * what gpufrac's node agent, MPS daemon and hook call.
 *
 * $GPUFRAC_FAKE_NVML_DIR holds its state, shared by every process that loads
 * it (the agent, the hook runc runs, the MPS daemon); without it, FAKE_NVML_DIR
 * does, where the chart test's node keeps it (runc gives a hook no environment
 * of the runtime's, so the hook the chart installs finds only that). Where the
 * directory has no machine file, Init answers DRIVER_NOT_LOADED: a copy of
 * this library left on a machine is no driver.
 *
 *   machine    what the library reports, written by the test from a go-nvml
 *              mock machine: "DRIVER CUDA" on the first line, then one
 *              "UUID MEMORY_MIB BUS_ID NAME..." line per GPU;
 *   limits     every accepted nvmlDeviceSetMemoryLimits_v1, one
 *              "set UUID SOFT HARD NAMESPACE DEV:INO" line each (bytes; the
 *              cgroup directory's device and inode), appended;
 *              nvmlDeviceGetMemoryLimits_v1 answers from the last line for
 *              the GPU and cgroup, as the driver answers from its table: the
 *              driver opens the path it is given, so a cgroup named through
 *              another mount of the hierarchy (the hook's host path, the
 *              agent's /host/sys/fs/cgroup in its pod) is the same one;
 *   used       what cgroups use, as the driver accounts it: one
 *              "UUID BYTES DEV:INO" line per GPU and cgroup, written by the
 *              test; nvmlDeviceGetMemoryLimits_v1 answers currentUsed from the
 *              last line for the GPU and cgroup (0 without one);
 *   fail-set   if present, every SetMemoryLimits_v1 returns the NVML code it
 *              holds (default NVML_ERROR_UNKNOWN), as a driver refusing would;
 *   processes  the GPUs' processes, written by the test: one
 *              "UUID PID BYTES SM KIND" line each, KIND "compute" (listed by
 *              nvmlDeviceGetComputeRunningProcesses_v3) or "mps" (an MPS
 *              client: nvmlDeviceGetMPSComputeRunningProcesses_v3); SM is
 *              its utilisation, which nvmlDeviceGetProcessUtilization
 *              reports as one sample per busy process (SM > 0) stamped now,
 *              NOT_FOUND when none is busy, as nvml.h says; the GPU's used
 *              memory (nvmlDeviceGetMemoryInfo: of the processes still
 *              alive, as the driver frees an exited one's) and utilisation
 *              are the sums;
 *   compute-mode-UUID
 *              the GPU's compute mode, as NVML numbers it (absent: Default),
 *              written by nvmlDeviceSetComputeMode (root only, as nvml.h
 *              says of it: "Requires root/admin permissions").
 *
 * SetMemoryLimits_v1 checks what nvml.h documents of the real call: root only
 * (NVML_ERROR_NO_PERMISSION), softLimit <= hardLimit <= the GPU's memory
 * (NVML_ERROR_INVALID_ARGUMENT), and nameSpace the "Full path to sysfs cgroup
 * file name" of a cgroup that can be opened (NVML_ERROR_OPERATING_SYSTEM):
 * here, an absolute path to a cgroup v2 directory (it has cgroup.procs).
 */
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "nvml.h"

#define MAX_GPUS 16
#define FAKE_NVML_DIR "/run/gpufrac-fake-nvml"

struct nvmlDevice_st {
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    char busid[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
    unsigned long long memory;
};

static struct nvmlDevice_st gpus[MAX_GPUS];
static unsigned int ngpus;
static char driver[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
static int cuda;
static int initialized; /* Init calls not yet matched by Shutdown */

static const char *state_path(const char *file, char *buf, size_t n) {
    const char *dir = getenv("GPUFRAC_FAKE_NVML_DIR");
    if (dir == NULL || *dir == '\0') dir = FAKE_NVML_DIR;
    snprintf(buf, n, "%s/%s", dir, file);
    return buf;
}

/* The machine is read once; Init and Shutdown are counted, as NVML counts
 * them (nvml.h, nvmlInit_v2: "A reference count of the number of
 * initializations is maintained"), so a Shutdown on one thread never pulls
 * the devices from under another's call. A line that does not parse fails Init: no GPU is
 * dropped silently. */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int loaded;

static nvmlReturn_t load(void) {
    char path[4096], line[512];
    FILE *f;
    if (state_path("machine", path, sizeof path) == NULL || (f = fopen(path, "r")) == NULL)
        return NVML_ERROR_DRIVER_NOT_LOADED;
    nvmlReturn_t ret = NVML_SUCCESS;
    if (fgets(line, sizeof line, f) == NULL || sscanf(line, "%79s %d", driver, &cuda) != 2) ret = NVML_ERROR_UNKNOWN;
    while (ret == NVML_SUCCESS && fgets(line, sizeof line, f) != NULL) {
        struct nvmlDevice_st *g = &gpus[ngpus];
        unsigned long long mib;
        if (line[0] == '\n') continue;
        if (ngpus == MAX_GPUS || strchr(line, '\n') == NULL ||
            sscanf(line, "%95s %llu %31s %95[^\n]", g->uuid, &mib, g->busid, g->name) != 4) {
            ret = NVML_ERROR_UNKNOWN;
            break;
        }
        g->memory = mib << 20;
        ngpus++;
    }
    fclose(f);
    if (ret != NVML_SUCCESS) ngpus = 0;
    return ret;
}

nvmlReturn_t nvmlInit_v2(void) {
    nvmlReturn_t ret = NVML_SUCCESS;
    pthread_mutex_lock(&lock);
    if (!loaded && (ret = load()) == NVML_SUCCESS) loaded = 1;
    if (ret == NVML_SUCCESS) initialized++;
    pthread_mutex_unlock(&lock);
    return ret;
}

nvmlReturn_t nvmlInit(void) { return nvmlInit_v2(); }

nvmlReturn_t nvmlShutdown(void) {
    nvmlReturn_t ret = NVML_SUCCESS;
    pthread_mutex_lock(&lock);
    if (initialized > 0) initialized--;
    else ret = NVML_ERROR_UNINITIALIZED;
    pthread_mutex_unlock(&lock);
    return ret;
}

static nvmlReturn_t copy(char *dst, unsigned int n, const char *src) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (dst == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > n) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(dst, src);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) { return copy(version, length, driver); }

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (v == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *v = cuda;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) { return nvmlSystemGetCudaDriverVersion(v); }

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *n) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (n == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *n = ngpus;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (i >= ngpus || d == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    d->handle = &gpus[i];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *d) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (uuid == NULL || d == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < ngpus; i++) {
        if (strcmp(gpus[i].uuid, uuid) == 0) { d->handle = &gpus[i]; return NVML_SUCCESS; }
    }
    return NVML_ERROR_NOT_FOUND;
}

/* nvmlDevice_t wraps a pointer to the library's own device record. */
static struct nvmlDevice_st *dev(nvmlDevice_t d) {
    return d.handle >= &gpus[0] && d.handle < &gpus[ngpus] ? d.handle : NULL;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int length) {
    struct nvmlDevice_st *g = dev(d);
    if (g == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    return copy(uuid, length, g->uuid);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int length) {
    struct nvmlDevice_st *g = dev(d);
    if (g == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    return copy(name, length, g->name);
}

/* One line of the processes file. */
struct fake_process {
    unsigned int pid;
    unsigned long long bytes;
    unsigned int sm;
    int mps;
};

/* processes reads up to max of GPU g's processes of a kind (-1: any). */
static unsigned int processes(struct nvmlDevice_st *g, int kind, struct fake_process *out, unsigned int max) {
    char path[4096], uuid[128], k[16];
    struct fake_process p;
    unsigned int n = 0;
    FILE *f;
    if (state_path("processes", path, sizeof path) == NULL || (f = fopen(path, "r")) == NULL) return 0;
    while (n < max && fscanf(f, "%127s %u %llu %u %15s\n", uuid, &p.pid, &p.bytes, &p.sm, k) == 5) {
        p.mps = strcmp(k, "mps") == 0;
        if (strcmp(uuid, g->uuid) == 0 && (kind < 0 || kind == p.mps)) out[n++] = p;
    }
    fclose(f);
    return n;
}

#define MAX_PROCESSES 256

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
    struct fake_process ps[MAX_PROCESSES];
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    struct nvmlDevice_st *g = dev(d);
    if (g == NULL || m == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int n = processes(g, -1, ps, MAX_PROCESSES);
    char proc[64];
    m->total = g->memory; m->used = 0;
    for (unsigned int i = 0; i < n; i++) {
        /* The driver frees an exited process's memory at once, whatever a
         * process list may still say of it. */
        snprintf(proc, sizeof proc, "/proc/%u", ps[i].pid);
        if (access(proc, F_OK) == 0) m->used += ps[i].bytes;
    }
    m->free = m->used < g->memory ? g->memory - m->used : 0;
    return NVML_SUCCESS;
}

static nvmlReturn_t running(nvmlDevice_t d, int mps, unsigned int *count, nvmlProcessInfo_t *infos) {
    struct fake_process ps[MAX_PROCESSES];
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    struct nvmlDevice_st *g = dev(d);
    if (g == NULL || count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int n = processes(g, mps, ps, MAX_PROCESSES);
    if (*count < n || (n > 0 && infos == NULL)) { *count = n; return NVML_ERROR_INSUFFICIENT_SIZE; }
    for (unsigned int i = 0; i < n; i++) {
        memset(&infos[i], 0, sizeof infos[i]);
        infos[i].pid = ps[i].pid;
        infos[i].usedGpuMemory = ps[i].bytes;
        infos[i].gpuInstanceId = infos[i].computeInstanceId = 0xFFFFFFFF; /* no MIG */
    }
    *count = n;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *count, nvmlProcessInfo_t *infos) {
    return running(d, 0, count, infos);
}

nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *count, nvmlProcessInfo_t *infos) {
    return running(d, 1, count, infos);
}

nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t d, nvmlProcessUtilizationSample_t *samples, unsigned int *count,
                                             unsigned long long lastSeen) {
    struct fake_process ps[MAX_PROCESSES];
    struct timespec now;
    (void)lastSeen; /* every sample is stamped now, so newer than any seen */
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    struct nvmlDevice_st *g = dev(d);
    if (g == NULL || count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int n = processes(g, -1, ps, MAX_PROCESSES), busy = 0;
    for (unsigned int i = 0; i < n; i++) if (ps[i].sm > 0) ps[busy++] = ps[i];
    if (busy == 0) return NVML_ERROR_NOT_FOUND;
    if (samples == NULL || *count < busy) { *count = busy; return NVML_ERROR_INSUFFICIENT_SIZE; }
    clock_gettime(CLOCK_REALTIME, &now);
    for (unsigned int i = 0; i < busy; i++) {
        memset(&samples[i], 0, sizeof samples[i]);
        samples[i].pid = ps[i].pid;
        samples[i].smUtil = ps[i].sm;
        samples[i].timeStamp = (unsigned long long)now.tv_sec * 1000000ULL + (unsigned long long)now.tv_nsec / 1000ULL;
    }
    *count = busy;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u) {
    struct fake_process ps[MAX_PROCESSES];
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    struct nvmlDevice_st *g = dev(d);
    if (g == NULL || u == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int n = processes(g, -1, ps, MAX_PROCESSES);
    u->gpu = 0; u->memory = 0;
    for (unsigned int i = 0; i < n; i++) u->gpu += ps[i].sm;
    if (u->gpu > 100) u->gpu = 100;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *p) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    struct nvmlDevice_st *g = dev(d);
    if (g == NULL || p == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    memset(p, 0, sizeof *p);
    snprintf(p->busId, sizeof p->busId, "%s", g->busid);
    snprintf(p->busIdLegacy, sizeof p->busIdLegacy, "%.15s", g->busid);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned int *current, unsigned int *pending) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    struct nvmlDevice_st *g = dev(d);
    if (g == NULL || current == NULL || pending == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *current = *pending = NVML_DEVICE_MIG_DISABLE;
    return NVML_SUCCESS;
}

static const char *mode_path(struct nvmlDevice_st *g, char *buf, size_t n) {
    char file[160];
    snprintf(file, sizeof file, "compute-mode-%s", g->uuid);
    return state_path(file, buf, n);
}

nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t d, nvmlComputeMode_t *mode) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    struct nvmlDevice_st *g = dev(d);
    char path[4096];
    FILE *f;
    int m = NVML_COMPUTEMODE_DEFAULT;
    if (g == NULL || mode == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (mode_path(g, path, sizeof path) != NULL && (f = fopen(path, "r")) != NULL) {
        if (fscanf(f, "%d", &m) != 1) m = NVML_COMPUTEMODE_DEFAULT;
        fclose(f);
    }
    *mode = (nvmlComputeMode_t)m;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceSetComputeMode(nvmlDevice_t d, nvmlComputeMode_t mode) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    struct nvmlDevice_st *g = dev(d);
    char path[4096], tmp[4200];
    FILE *f;
    if (g == NULL || (int)mode < 0 || mode >= NVML_COMPUTEMODE_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    if (geteuid() != 0) return NVML_ERROR_NO_PERMISSION;
    if (mode_path(g, path, sizeof path) == NULL) return NVML_ERROR_UNKNOWN;
    snprintf(tmp, sizeof tmp, "%s.%d.tmp", path, (int)getpid());
    if ((f = fopen(tmp, "w")) == NULL) return NVML_ERROR_UNKNOWN;
    fprintf(f, "%d\n", (int)mode);
    if (fclose(f) != 0 || rename(tmp, path) != 0) return NVML_ERROR_UNKNOWN;
    return NVML_SUCCESS;
}

/* cgroup_ok is what the driver needs of a nameSpace: a cgroup v2 directory
 * it can open, named by its full sysfs path. */
static int cgroup_ok(const char *ns) {
    char procs[4096];
    struct stat st;
    if (ns == NULL || ns[0] != '/') return 0;
    snprintf(procs, sizeof procs, "%s/cgroup.procs", ns);
    return stat(ns, &st) == 0 && S_ISDIR(st.st_mode) && access(procs, R_OK) == 0;
}

nvmlReturn_t nvmlDeviceSetMemoryLimits_v1(nvmlDevice_t d, nvmlSetMemoryLimits_v1_t *l) {
    char path[4096], line[4096];
    struct stat st;
    FILE *f;
    int fd, n;
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    struct nvmlDevice_st *g = dev(d);
    if (g == NULL || l == NULL || l->softLimit > l->hardLimit) return NVML_ERROR_INVALID_ARGUMENT;
    if (l->hardLimit > g->memory && l->hardLimit != NVML_DEVICE_MEMORY_LIMIT_MAX) return NVML_ERROR_INVALID_ARGUMENT;
    if (geteuid() != 0) return NVML_ERROR_NO_PERMISSION;
    if (state_path("fail-set", path, sizeof path) && (f = fopen(path, "r")) != NULL) {
        int code = NVML_ERROR_UNKNOWN;
        if (fscanf(f, "%d", &code) != 1) code = NVML_ERROR_UNKNOWN;
        fclose(f);
        return (nvmlReturn_t)code;
    }
    if (!cgroup_ok(l->nameSpace) || stat(l->nameSpace, &st) != 0) return NVML_ERROR_OPERATING_SYSTEM;
    if (state_path("limits", path, sizeof path) == NULL) return NVML_ERROR_UNKNOWN;
    n = snprintf(line, sizeof line, "set %s %llu %llu %s %llu:%llu\n", g->uuid, l->softLimit, l->hardLimit, l->nameSpace,
                 (unsigned long long)st.st_dev, (unsigned long long)st.st_ino);
    if (n <= 0 || (size_t)n >= sizeof line) return NVML_ERROR_INVALID_ARGUMENT;
    /* One write with O_APPEND: lines from concurrent hooks never interleave. */
    if ((fd = open(path, O_WRONLY | O_APPEND | O_CREAT, 0644)) < 0) return NVML_ERROR_UNKNOWN;
    if (write(fd, line, (size_t)n) != n) { close(fd); return NVML_ERROR_UNKNOWN; }
    close(fd);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryLimits_v1(nvmlDevice_t d, nvmlGetMemoryLimits_v1_t *l) {
    char path[4096], uuid[128], ns[4096];
    unsigned long long soft, hard, sdev, sino;
    struct stat st;
    int found = 0;
    FILE *f;
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    struct nvmlDevice_st *g = dev(d);
    if (g == NULL || l == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (!cgroup_ok(l->nameSpace) || stat(l->nameSpace, &st) != 0) return NVML_ERROR_OPERATING_SYSTEM;
    if (state_path("limits", path, sizeof path) == NULL || (f = fopen(path, "r")) == NULL) return NVML_ERROR_NOT_FOUND;
    while (fscanf(f, "set %127s %llu %llu %4095s %llu:%llu\n", uuid, &soft, &hard, ns, &sdev, &sino) == 6) {
        if (strcmp(uuid, g->uuid) == 0 && sdev == (unsigned long long)st.st_dev && sino == (unsigned long long)st.st_ino) {
            l->softLimit = soft; l->hardLimit = hard; l->currentUsed = 0;
            found = 1;
        }
    }
    fclose(f);
    if (found && state_path("used", path, sizeof path) && (f = fopen(path, "r")) != NULL) {
        unsigned long long used;
        while (fscanf(f, "%127s %llu %llu:%llu\n", uuid, &used, &sdev, &sino) == 4) {
            if (strcmp(uuid, g->uuid) == 0 && sdev == (unsigned long long)st.st_dev && sino == (unsigned long long)st.st_ino) {
                l->currentUsed = used;
            }
        }
        fclose(f);
    }
    return found ? NVML_SUCCESS : NVML_ERROR_NOT_FOUND;
}

const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request";
    default: return "Unknown Error";
    }
}
