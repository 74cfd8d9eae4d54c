package admission

import (
	"fmt"
	"slices"
	"strconv"

	"gomodules.xyz/jsonpatch/v2"
	corev1 "k8s.io/api/core/v1"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// A pod that holds a share is a client of its node's MPS control daemon,
// and the daemon obeys root's administrative commands (quit ends every
// tenant's GPU context on the node; measured on an H200, docs/gpu-proof).
// The node refuses a share container whose uid is 0, but a uid is only
// where a process starts: a setuid-root helper in the image, or a root
// container that shares the share container's process namespace (and so
// reaches its MPS pipe directory through /proc/<pid>/root), becomes root
// after the check. So a share pod outside a user namespace must not gain
// privileges (no_new_privs: setuid and file capabilities do nothing) and
// must not share a process namespace. In a user namespace (hostUsers:
// false) its root is no root of the host, and none of this applies.

// clientPatches makes the pod a safe MPS client, or says why it cannot be
// one: allowPrivilegeEscalation false on every container that leaves it
// unset (Kubernetes' default is true), and a refusal, naming the field,
// of what cannot be mended without changing what the pod asked for.
// allowRoot (the node agent's --allow-root-mps-clients) accepts the risk.
func clientPatches(pod *corev1.Pod, allowRoot bool) ([]jsonpatch.JsonPatchOperation, error) {
	if allowRoot || InUserNamespace(&pod.Spec) {
		return nil, nil
	}
	if err := CheckMPSClientPod(&pod.Spec); err != nil {
		return nil, err
	}
	var patches []jsonpatch.JsonPatchOperation
	set := func(base string, c corev1.Container) {
		switch {
		case c.SecurityContext == nil:
			patches = append(patches, jsonpatch.JsonPatchOperation{Operation: "add", Path: base + "/securityContext",
				Value: map[string]any{"allowPrivilegeEscalation": false}})
		case c.SecurityContext.AllowPrivilegeEscalation == nil:
			patches = append(patches, jsonpatch.JsonPatchOperation{Operation: "add", Path: base + "/securityContext/allowPrivilegeEscalation", Value: false})
		}
	}
	for i, c := range pod.Spec.InitContainers {
		set("/spec/initContainers/"+strconv.Itoa(i), c)
	}
	for i, c := range pod.Spec.Containers {
		set("/spec/containers/"+strconv.Itoa(i), c)
	}
	return patches, nil
}

// InUserNamespace says whether the pod's containers run in a user
// namespace of their own (hostUsers: false).
func InUserNamespace(spec *corev1.PodSpec) bool {
	return spec.HostUsers != nil && !*spec.HostUsers
}

// CheckMPSClientPod refuses a pod holding a share, outside a user
// namespace, whose containers could become root on the host after the
// node checked their uid: one that shares its process namespace, or a
// container that asks to gain privileges (or is privileged, or adds
// CAP_SYS_ADMIN, either of which Kubernetes allows only with escalation).
// Containers that leave allowPrivilegeEscalation unset pass here: the
// mutating webhook sets it false on them.
func CheckMPSClientPod(spec *corev1.PodSpec) error {
	if InUserNamespace(spec) {
		return nil
	}
	const why = "a pod holding a GPU share is a client of the node's MPS daemon, which obeys root (quit ends every tenant's GPU context)"
	if spec.ShareProcessNamespace != nil && *spec.ShareProcessNamespace {
		return api.ErrorList{{Key: "spec.shareProcessNamespace", Value: "true",
			Rule: "cannot be set on " + why + ", and another container of the pod could reach the share's MPS pipe directory through /proc as root: drop it, or run the pod in a user namespace (hostUsers: false)"}}
	}
	check := func(kind string, c corev1.Container) error {
		sc := c.SecurityContext
		if sc == nil {
			return nil
		}
		field := fmt.Sprintf("%s %q securityContext.", kind, c.Name)
		switch {
		case sc.Privileged != nil && *sc.Privileged:
			return api.ErrorList{{Key: field + "privileged", Value: "true",
				Rule: "cannot be set on " + why + ": a privileged container becomes root at will; run the pod in a user namespace (hostUsers: false) or without privilege"}}
		case sc.AllowPrivilegeEscalation != nil && *sc.AllowPrivilegeEscalation:
			return api.ErrorList{{Key: field + "allowPrivilegeEscalation", Value: "true",
				Rule: "cannot be set on " + why + ": a setuid-root program in the image would become root after the node checked the container's user; set it false (or leave it unset), or run the pod in a user namespace (hostUsers: false)"}}
		case sc.Capabilities != nil && slices.Contains(sc.Capabilities.Add, "SYS_ADMIN"), sc.Capabilities != nil && slices.Contains(sc.Capabilities.Add, "CAP_SYS_ADMIN"):
			return api.ErrorList{{Key: field + "capabilities.add", Value: "SYS_ADMIN",
				Rule: "cannot be added on " + why + ": Kubernetes lets a container with it gain privileges; drop it, or run the pod in a user namespace (hostUsers: false)"}}
		}
		return nil
	}
	for _, c := range spec.InitContainers {
		if err := check("init container", c); err != nil {
			return err
		}
	}
	for _, c := range spec.Containers {
		if err := check("container", c); err != nil {
			return err
		}
	}
	return nil
}

// CheckEphemeralContainers refuses, in a pod holding a share outside a
// user namespace, an ephemeral container (kubectl debug) that joins
// another container's process namespace (targetContainerName): from
// there it reaches the share's MPS pipe directory through /proc. One
// without a target gets a process namespace of its own.
func CheckEphemeralContainers(old, pod *corev1.Pod) error {
	if InUserNamespace(&pod.Spec) {
		return nil
	}
	for _, e := range pod.Spec.EphemeralContainers {
		if e.TargetContainerName == "" || slices.ContainsFunc(old.Spec.EphemeralContainers, func(o corev1.EphemeralContainer) bool { return o.Name == e.Name }) {
			continue
		}
		return api.ErrorList{{Key: fmt.Sprintf("ephemeral container %q targetContainerName", e.Name), Value: e.TargetContainerName,
			Rule: "cannot be set in a pod holding a GPU share: the debug container would share the process namespace of a client of the node's MPS daemon and reach its pipe directory through /proc; debug without a target, or run the pod in a user namespace (hostUsers: false)"}}
	}
	return nil
}

// stripCharge removes a charge (api.ResourceGPUMemory) the pod's author
// wrote on a pod that holds no share: only the webhook writes one. A plain
// pod asking for 4095Ti of it would otherwise be placed by any scheduler
// on a GPU node (which advertises api.ChargeCapacity) and use it up, so
// that the kubelet refuses every share placed there after it.
func stripCharge(pod *corev1.Pod) []jsonpatch.JsonPatchOperation {
	return chargePatches(pod, -1)
}
