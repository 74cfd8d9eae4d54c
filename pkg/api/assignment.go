package api

import (
	"fmt"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
)

// Assignment is the scheduler's decision for one container, as written on
// the pod once it is scheduled: the GPUs it got and the memory and compute
// to enforce on each. The node side enforces exactly this and nothing the
// pod claims elsewhere, whichever scheduler (gpufrac's or KAI's) wrote it.
type Assignment struct {
	Container string
	// Devices are the assigned GPU UUIDs, distinct, in the scheduler's order.
	Devices []string
	// RequestMiB is the guaranteed (soft) limit on each device.
	RequestMiB int64
	// LimitMiB is the hard limit on each device, ≥ RequestMiB.
	LimitMiB int64
	Mode     ComputeMode
	// Portion is the sm-sharing compute share in (0,1]; zero for time-slicing.
	Portion Fraction
}

// ActiveThreadPercentage is the MPS active-thread ceiling for an sm-sharing
// portion: floor(portion × 100), at least 1 so a tiny share still runs.
func (a Assignment) ActiveThreadPercentage() int {
	return max(int(a.Portion.Of(100)), 1)
}

// Annotations are the keys a scheduler writes on the pod for this
// decision (SPEC §2): the devices, the resolved memory in Mi, the compute
// mode and, for sm-sharing, the portion. It is the one writer of the keys
// ParseAssignments reads: ParseAssignments(a.Annotations()) is a again.
func (a Assignment) Annotations() map[string]string {
	key := func(suffix string) string { return ContainerKey(a.Container, suffix) }
	out := map[string]string{
		key(SuffixDevices):       strings.Join(a.Devices, ","),
		key(SuffixMemoryRequest): strconv.FormatInt(a.RequestMiB, 10) + "Mi",
		key(SuffixMemoryLimit):   strconv.FormatInt(a.LimitMiB, 10) + "Mi",
		key(SuffixComputeMode):   string(a.Mode),
	}
	if a.Mode == SMSharing {
		out[key(SuffixComputePortion)] = a.Portion.String()
	}
	return out
}

// ParseAssignments reads the scheduler's decisions from a scheduled pod:
// the one reader of what Assignment.Annotations writes, for the node
// agent, the audit, gpufrac top and the scheduler's own rebuild. It
// returns nil and no error for a pod with no GPU-fraction annotations. A
// container that asks for a fraction but lacks a complete, consistent
// decision is an error: the node must refuse it rather than run it
// without limits.
func ParseAssignments(annotations map[string]string) ([]Assignment, error) {
	var errs ErrorList
	fail := func(c, key, value, rule string, args ...any) {
		errs = append(errs, &FieldError{Container: c, Key: key, Value: value, Rule: fmt.Sprintf(rule, args...)})
	}
	perContainer := map[string]map[string]string{}
	for key, value := range annotations {
		c, suffix, ok := SplitContainerKey(key)
		if !ok || c == "" || suffix == "" {
			continue
		}
		if perContainer[c] == nil {
			perContainer[c] = map[string]string{}
		}
		perContainer[c][suffix] = value
	}
	if shorthand, asks := shorthandKey(annotations); asks {
		target, named := annotations[KeyContainerName]
		switch {
		case named && perContainer[target] == nil:
			perContainer[target] = map[string]string{}
		case !named && len(perContainer) == 0:
			// Which container the shorthand targets (the first) only the
			// pod's spec says; that none has a decision is enough to refuse.
			fail("", shorthand, annotations[shorthand], "asks for a GPU fraction, but no scheduler has assigned the pod GPUs (no %s)", ContainerKey("<container>", SuffixDevices))
		}
	}
	names := make([]string, 0, len(perContainer))
	for c := range perContainer {
		names = append(names, c)
	}
	slices.Sort(names)

	var out []Assignment
	for _, c := range names {
		values := perContainer[c]
		devicesKey := ContainerKey(c, SuffixDevices)
		raw, ok := values[SuffixDevices]
		if !ok {
			fail(c, devicesKey, "", "is missing: the container asks for a GPU fraction but no scheduler has assigned it GPUs")
			continue
		}
		devices, bad := splitDevices(raw)
		if bad != "" {
			fail(c, devicesKey, raw, "must be a comma-separated list of distinct GPU UUIDs: %s", bad)
			continue
		}
		a := Assignment{Container: c, Devices: devices, Mode: TimeSlicing}
		p := parser{}
		reqKey, limitKey := ContainerKey(c, SuffixMemoryRequest), ContainerKey(c, SuffixMemoryLimit)
		req, hasReq := p.quantityMiB(c, reqKey, values, SuffixMemoryRequest, false)
		limit, hasLimit := p.quantityMiB(c, limitKey, values, SuffixMemoryLimit, false)
		errs = append(errs, p.errs...)
		switch {
		case len(p.errs) > 0:
			continue
		case !hasReq && !hasLimit:
			fail(c, reqKey, "", "is missing: the scheduler writes the resolved memory request with the devices")
			continue
		case !hasReq:
			req = limit
		case !hasLimit:
			limit = req
		}
		if limit < req {
			fail(c, limitKey, values[SuffixMemoryLimit], "must be at least the memory request (%dMi)", req)
			continue
		}
		a.RequestMiB, a.LimitMiB = req, limit
		if m, present := values[SuffixComputeMode]; present {
			mode, valid := ParseComputeMode(m)
			if !valid {
				fail(c, ContainerKey(c, SuffixComputeMode), m, "must be %s or %s", TimeSlicing, SMSharing)
				continue
			}
			a.Mode = mode
		}
		portionKey := ContainerKey(c, SuffixComputePortion)
		if v, present := values[SuffixComputePortion]; present {
			f, err := ParseFraction(v)
			if err != nil || f.IsZero() {
				fail(c, portionKey, v, "must be a decimal greater than 0 and at most 1")
				continue
			}
			a.Portion = f
		}
		if a.Mode == SMSharing && a.Portion.IsZero() {
			fail(c, portionKey, "", "is missing: sm-sharing needs the compute portion the scheduler assigns")
			continue
		}
		out = append(out, a)
	}
	if len(errs) > 0 {
		return nil, errs
	}
	return out, nil
}

// shorthandKey is the first pod-level shorthand the pod carries, if any.
func shorthandKey(annotations map[string]string) (string, bool) {
	for _, k := range shorthandKeys {
		if _, ok := annotations[k]; ok {
			return k, true
		}
	}
	return "", false
}

// splitDevices parses a device list; bad says what is wrong, if anything.
func splitDevices(raw string) (devices []string, bad string) {
	for _, d := range strings.Split(raw, ",") {
		d = strings.TrimSpace(d)
		switch {
		case d == "":
			return nil, "an entry is empty"
		case strings.ContainsFunc(d, func(r rune) bool { return r <= ' ' || r > '~' }):
			return nil, fmt.Sprintf("%q has characters a UUID does not", d)
		case slices.Contains(devices, d):
			return nil, fmt.Sprintf("%q is listed twice", d)
		}
		devices = append(devices, d)
	}
	return devices, ""
}

// Intent returns the pod without the keys a scheduler writes when it
// places it, so that a placed pod, or one whose binding failed after it
// was annotated, is read by Parse for what its author asked. The resolved
// memory keys go too when a shorthand asked for the memory: their values
// came from the scheduler.
func Intent(pod *corev1.Pod) *corev1.Pod {
	if !HasContainerKey(pod.Annotations, SuffixDevices, SuffixComputePortion) && !hasGroups(pod) {
		return pod
	}
	out := pod.DeepCopy()
	_, shorthand := out.Annotations[KeyFraction]
	if _, mem := out.Annotations[KeyMemory]; mem {
		shorthand = true
	}
	delete(out.Annotations, GPUGroupsAnnotation)
	for k := range out.Annotations {
		_, suffix, ok := SplitContainerKey(k)
		if !ok {
			continue
		}
		switch {
		case suffix == SuffixDevices || suffix == SuffixComputePortion:
			delete(out.Annotations, k)
		case shorthand && (suffix == SuffixMemoryRequest || suffix == SuffixMemoryLimit):
			delete(out.Annotations, k)
		}
	}
	return out
}

// HasContainerKey says whether a per-container key with one of the
// suffixes is set, for any container.
func HasContainerKey(annotations map[string]string, suffixes ...string) bool {
	for k := range annotations {
		if _, suffix, ok := SplitContainerKey(k); ok && slices.Contains(suffixes, suffix) {
			return true
		}
	}
	return false
}

func hasGroups(pod *corev1.Pod) bool {
	_, ok := pod.Annotations[GPUGroupsAnnotation]
	return ok
}
