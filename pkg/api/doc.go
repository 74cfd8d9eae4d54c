// Package api is gpufrac's pod API: the annotation keys a pod uses to ask
// for a fraction of a GPU, the Request model they describe, and Parse,
// which applies every rule of the specification and explains each
// violation in one line.
//
// The package is pure: no client, no I/O. The webhook, the scheduler
// plugin, the node agent and `gpufrac validate` all call it, so a pod is
// judged by the same rules everywhere.
//
// The keys are those of NVIDIA's KAI Scheduler (NvFractions mode):
// canonical per-container keys nvidia.com/container.<c>.<suffix>, and
// pod-level shorthands (gpu-fraction, gpu-memory, ...) that admission
// rewrites into them.
package api
