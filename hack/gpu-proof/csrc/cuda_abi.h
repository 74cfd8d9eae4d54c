/*
 * The few CUDA driver API types and constants probe.c calls and
 * fakecuda.c implements, as cuda.h declares them: one definition, so that
 * the probe and its stand-in cannot disagree on the ABI, and no CUDA
 * toolkit is needed to build either.
 */
#ifndef GPUFRAC_CUDA_ABI_H
#define GPUFRAC_CUDA_ABI_H

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUmodule;
typedef void *CUfunction;
typedef unsigned long long CUdeviceptr;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NO_DEVICE 100
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_INVALID_IMAGE 200
#define CUDA_ERROR_NOT_FOUND 500
#define CU_DEVICE_ATTRIBUTE_CLOCK_RATE 13 /* kHz */

#endif
