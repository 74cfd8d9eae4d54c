/* What nvidia-smi does for memory: load libnvidia-ml.so.1 by name and ask
 * each GPU's memory info. Prints one line per GPU. */
#include <dlfcn.h>
#include <stdio.h>
typedef int nvmlReturn_t;
typedef void *nvmlDevice_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;

int main(void) {
    void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!h) { printf("dlopen: %s\n", dlerror()); return 1; }
    nvmlReturn_t (*init)(void) = (nvmlReturn_t (*)(void))dlsym(h, "nvmlInit_v2");
    nvmlReturn_t (*count)(unsigned int *) = (nvmlReturn_t (*)(unsigned int *))dlsym(h, "nvmlDeviceGetCount_v2");
    nvmlReturn_t (*byIndex)(unsigned int, nvmlDevice_t *) = (nvmlReturn_t (*)(unsigned int, nvmlDevice_t *))dlsym(h, "nvmlDeviceGetHandleByIndex_v2");
    nvmlReturn_t (*mem)(nvmlDevice_t, nvmlMemory_t *) = (nvmlReturn_t (*)(nvmlDevice_t, nvmlMemory_t *))dlsym(h, "nvmlDeviceGetMemoryInfo");
    nvmlReturn_t (*mem2)(nvmlDevice_t, nvmlMemory_v2_t *) = (nvmlReturn_t (*)(nvmlDevice_t, nvmlMemory_v2_t *))dlsym(h, "nvmlDeviceGetMemoryInfo_v2");
    nvmlReturn_t (*name)(nvmlDevice_t, char *, unsigned int) = (nvmlReturn_t (*)(nvmlDevice_t, char *, unsigned int))dlsym(h, "nvmlDeviceGetName");
    if (!init || !count || !byIndex || !mem || !mem2 || !name) { printf("missing symbol\n"); return 1; }
    nvmlReturn_t r = init();
    if (r) { printf("init=%d\n", r); return 0; }
    unsigned int n = 0;
    count(&n);
    for (unsigned int i = 0; i < n; i++) {
        nvmlDevice_t d;
        nvmlMemory_t m;
        nvmlMemory_v2_t m2 = {0};
        char buf[64];
        byIndex(i, &d);
        mem(d, &m);
        mem2(d, &m2);
        printf("gpu=%u total=%llu used=%llu free=%llu v2total=%llu v2reserved=%llu v2free=%llu name=%d\n",
               i, m.total >> 20, m.used >> 20, m.free >> 20, m2.total >> 20, m2.reserved >> 20, m2.free >> 20, name(d, buf, sizeof buf));
    }
    /* nvidia-smi's first call: the real library's internal table. */
    nvmlReturn_t (*table)(const void **, const void *) = (nvmlReturn_t (*)(const void **, const void *))dlsym(h, "nvmlInternalGetExportTable");
    const void *t = NULL;
    if (!table) printf("export table: missing\n");
    else if ((r = table(&t, NULL)) != 0) printf("export table: %d\n", r);
    else printf("export table: %llx\n", *(const unsigned long long *)t);
    return 0;
}
