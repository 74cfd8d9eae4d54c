package api

import (
	"errors"
	"fmt"
	"math"
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
	// Devices are the assigned GPU UUIDs, distinct, in the scheduler's order,
	// however the scheduler named them.
	Devices []string
	// CDIKind is the CDI kind the scheduler named the devices with
	// (<kind>=<UUID>, e.g. k8s.device-plugin.nvidia.com/gpu, as KAI writes
	// on CDI clusters); "" when it wrote bare UUIDs.
	CDIKind string
	// RequestMiB is the guaranteed (soft) limit on each device.
	RequestMiB int64
	// LimitMiB is the hard limit on each device, ≥ RequestMiB.
	LimitMiB int64
	Mode     ComputeMode
	// Portion is the sm-sharing compute share in (0,1]; zero for
	// time-slicing, and for sm-sharing when the scheduler wrote none (as
	// released KAI does): the node then derives it from the memory share.
	Portion Fraction
}

// CDIKindNVIDIAGPU is the CDI kind of NVIDIA's device plugin, the one KAI
// names devices with on CDI clusters: its CDI spec carries the container
// toolkit's memory-limit hook.
const CDIKindNVIDIAGPU = "k8s.device-plugin.nvidia.com/gpu"

// DeviceNames are the devices as the scheduler wrote them: bare UUIDs, or
// CDI names <CDIKind>=<UUID>.
func (a Assignment) DeviceNames() []string {
	if a.CDIKind == "" {
		return a.Devices
	}
	names := make([]string, len(a.Devices))
	for i, d := range a.Devices {
		names[i] = a.CDIKind + "=" + d
	}
	return names
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
		key(SuffixDevices):       strings.Join(a.DeviceNames(), ","),
		key(SuffixMemoryRequest): strconv.FormatInt(a.RequestMiB, 10) + "Mi",
		key(SuffixMemoryLimit):   strconv.FormatInt(a.LimitMiB, 10) + "Mi",
		key(SuffixComputeMode):   string(a.Mode),
	}
	if a.Mode == SMSharing && !a.Portion.IsZero() {
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
//
// It reads every form a scheduler writes (KAI's binder included):
// quantities canonical or not (2Gi, 2048Mi), values with surrounding
// whitespace, a portion in exponent form, devices as bare UUIDs or as CDI
// names, sm-sharing without a portion. It keeps refusing what no scheduler
// writes.
//
// On error, the slice still holds the containers whose devices and memory
// read cleanly, with Mode empty where only their mode or portion did not:
// a node that fails open keeps their memory caps (see package injection).
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
		perContainer[c][suffix] = strings.TrimSpace(value)
	}
	// The containers with a decision, or asking for one: a mode or a
	// portion alone asks for nothing, as KAI's node operator reads it
	// (KAI's own reservation pods carry .gpu-compute.mode and a whole GPU).
	var names []string
	for c, values := range perContainer {
		_, devices := values[SuffixDevices]
		_, req := values[SuffixMemoryRequest]
		_, limit := values[SuffixMemoryLimit]
		if devices || req || limit {
			names = append(names, c)
		}
	}
	if shorthand, asks := memoryShorthand(annotations); asks {
		target, named := annotations[KeyContainerName]
		switch {
		case named && !slices.Contains(names, target):
			names = append(names, target)
			if perContainer[target] == nil {
				perContainer[target] = map[string]string{}
			}
		case !named && len(names) == 0:
			// Which container the shorthand targets (the first) only the
			// pod's spec says; that none has a decision is enough to refuse.
			fail("", shorthand, annotations[shorthand], "asks for a GPU fraction, but no scheduler has assigned the pod GPUs (no %s)", ContainerKey("<container>", SuffixDevices))
		}
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
		devices, kind, bad := ParseDeviceList(raw)
		if bad != "" {
			fail(c, devicesKey, raw, "must be a comma-separated list of distinct GPU UUIDs or CDI device names (<kind>=<UUID>): %s", bad)
			continue
		}
		a := Assignment{Container: c, Devices: devices, CDIKind: kind}
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
		// From here on the memory caps are known: a bad mode or portion
		// leaves the assignment in the result, with no mode.
		a.Mode = TimeSlicing
		if m, present := values[SuffixComputeMode]; present {
			mode, valid := ParseComputeMode(m)
			if !valid {
				fail(c, ContainerKey(c, SuffixComputeMode), m, "must be %s or %s", TimeSlicing, SMSharing)
			}
			a.Mode = mode
		}
		if v, present := values[SuffixComputePortion]; present && a.Mode != "" {
			f, ok := parsePortion(v)
			if !ok {
				fail(c, ContainerKey(c, SuffixComputePortion), v, "must be a decimal greater than 0 and at most 1")
				a.Mode = ""
			}
			a.Portion = f
		}
		if a.Mode != SMSharing {
			// A time-slicing tenant is never compute-capped; a binder that
			// writes a portion for every fraction (KAI's newer one does)
			// has it checked, and ignored.
			a.Portion = Fraction{}
		}
		out = append(out, a)
	}
	if len(errs) > 0 {
		return out, errs
	}
	return out, nil
}

// parsePortion reads a compute portion in (0,1]: a plain decimal, or any
// form strconv.ParseFloat reads ("5e-01"), kept exact through its shortest
// decimal rendering.
func parsePortion(v string) (Fraction, bool) {
	f, err := ParseFraction(v)
	if errors.Is(err, errNotDecimal) {
		x, perr := strconv.ParseFloat(v, 64)
		if perr != nil || math.IsNaN(x) || math.IsInf(x, 0) || x <= 0 || x > 1 {
			return Fraction{}, false
		}
		f, err = ParseFraction(strconv.FormatFloat(x, 'f', -1, 64))
	}
	return f, err == nil && !f.IsZero()
}

// memoryShorthand is the first pod-level shorthand the pod carries that
// asks for memory, if any: a container name, a device count or a compute
// mode alone asks for no GPU share (KAI ignores them then).
func memoryShorthand(annotations map[string]string) (string, bool) {
	for _, k := range []string{KeyFraction, KeyMemory, KeyFractionLimit, KeyMemoryLimit} {
		if _, ok := annotations[k]; ok {
			return k, true
		}
	}
	return "", false
}

// AsksForFraction reports whether a pod's annotations ask for a GPU share
// the node must enforce: a memory shorthand, or a container's memory or
// devices key. A compute mode or a container name alone asks for none. A
// malformed key under ContainerKeyPrefix, which no scheduler writes,
// counts as asking, so that the node refuses the pod rather than guess.
func AsksForFraction(annotations map[string]string) bool {
	if _, ok := memoryShorthand(annotations); ok {
		return true
	}
	for k := range annotations {
		c, suffix, ok := SplitContainerKey(k)
		if ok && (c == "" || suffix == "" || suffix == SuffixDevices || suffix == SuffixMemoryRequest || suffix == SuffixMemoryLimit) {
			return true
		}
	}
	return false
}

// ParseDeviceList reads a .gpus.devices value: distinct GPU UUIDs, bare or
// all as CDI names of one kind (<vendor>/<class>=<UUID>). It returns the
// UUIDs and the CDI kind ("" for bare UUIDs); bad says what is wrong,
// naming the entry, when the list is not one of those.
func ParseDeviceList(raw string) (uuids []string, cdiKind, bad string) {
	for i, entry := range strings.Split(raw, ",") {
		entry = strings.TrimSpace(entry)
		if entry == "" {
			return nil, "", "an entry is empty"
		}
		kind, uuid, isCDI := strings.Cut(entry, "=")
		if !isCDI {
			kind, uuid = "", entry
		}
		switch {
		case isCDI && !isCDIKind(kind):
			return nil, "", fmt.Sprintf("%q is not a CDI device name: the kind %q must be <vendor>/<class>, such as %s", entry, kind, CDIKindNVIDIAGPU)
		case !isGPUUUID(uuid):
			return nil, "", fmt.Sprintf("%q is not a GPU UUID (GPU-<hex digits and dashes>, as nvidia-smi -L prints)%s", entry, notUUIDHint(uuid))
		case i > 0 && kind != cdiKind:
			return nil, "", fmt.Sprintf("%q is named differently from the first entry: every entry must be a bare UUID, or every one a CDI name of one kind", entry)
		case slices.Contains(uuids, uuid):
			return nil, "", fmt.Sprintf("%q is listed twice", entry)
		}
		cdiKind = kind
		uuids = append(uuids, uuid)
	}
	return uuids, cdiKind, ""
}

// isGPUUUID reports whether s has the shape of an NVML GPU UUID: "GPU-"
// and hex digits with dashes (8-4-4-4-12 on today's GPUs; the grouping is
// not checked, so the reader does not guess at a future one).
func isGPUUUID(s string) bool {
	body, ok := strings.CutPrefix(s, "GPU-")
	if !ok || strings.Trim(body, "-") == "" {
		return false
	}
	return !strings.ContainsFunc(body, func(r rune) bool { return !isHexDigit(r) && r != '-' })
}

func isHexDigit(r rune) bool {
	return '0' <= r && r <= '9' || 'a' <= r && r <= 'f' || 'A' <= r && r <= 'F'
}

func notUUIDHint(s string) string {
	switch {
	case strings.HasPrefix(s, "MIG-"):
		return "; a MIG device cannot be shared by fractions"
	case allDigits(s):
		return "; device indices differ from node to node and are not accepted"
	}
	return ""
}

// isCDIKind checks the CDI spec's kind syntax, <vendor>/<class>: each a
// name of letters, digits, '-', '_' and '.', starting and ending with a
// letter or digit.
func isCDIKind(kind string) bool {
	vendor, class, ok := strings.Cut(kind, "/")
	name := func(s string) bool {
		if s == "" || !isAlnum(rune(s[0])) || !isAlnum(rune(s[len(s)-1])) {
			return false
		}
		for _, r := range s {
			if !isAlnum(r) && r != '-' && r != '_' && r != '.' {
				return false
			}
		}
		return true
	}
	return ok && name(vendor) && name(class)
}

func isAlnum(r rune) bool {
	return 'a' <= r && r <= 'z' || 'A' <= r && r <= 'Z' || '0' <= r && r <= '9'
}

// Intent returns the pod without the keys a scheduler writes when it
// places it, so that a placed pod, or one whose binding failed after it
// was annotated, is read by Parse for what its author asked. gpufrac's
// scheduler lists the memory keys it added (ResolvedKeysAnnotation), and
// exactly those go; for another scheduler's decision (KAI's binder), the
// memory keys go when a shorthand asked for the memory, since their
// values then came from the scheduler.
func Intent(pod *corev1.Pod) *corev1.Pod {
	if !HasContainerKey(pod.Annotations, SuffixDevices, SuffixComputePortion) && !hasGroups(pod) {
		return pod
	}
	out := pod.DeepCopy()
	resolved, listed := out.Annotations[ResolvedKeysAnnotation]
	_, shorthand := out.Annotations[KeyFraction]
	if _, mem := out.Annotations[KeyMemory]; mem {
		shorthand = true
	}
	delete(out.Annotations, GPUGroupsAnnotation)
	delete(out.Annotations, ResolvedKeysAnnotation)
	for k := range out.Annotations {
		_, suffix, ok := SplitContainerKey(k)
		if !ok {
			continue
		}
		switch {
		case suffix == SuffixDevices || suffix == SuffixComputePortion:
			delete(out.Annotations, k)
		case listed && slices.Contains(SplitList(resolved), suffix):
			delete(out.Annotations, k)
		case !listed && shorthand && (suffix == SuffixMemoryRequest || suffix == SuffixMemoryLimit):
			delete(out.Annotations, k)
		}
	}
	return out
}

// ResolvedMemoryKeys are the suffixes of the memory keys a decision adds to
// a pod that lacks them: what a scheduler records in
// ResolvedKeysAnnotation so that Intent can tell them from its author's.
// previous is the annotation's value from an earlier attempt, if any.
func ResolvedMemoryKeys(annotations map[string]string, container, previous string) string {
	keys := SplitList(previous)
	for _, suffix := range []string{SuffixMemoryRequest, SuffixMemoryLimit} {
		if _, set := annotations[ContainerKey(container, suffix)]; !set && !slices.Contains(keys, suffix) {
			keys = append(keys, suffix)
		}
	}
	slices.Sort(keys)
	return strings.Join(keys, ",")
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
