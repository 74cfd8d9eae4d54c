package api

import (
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

const (
	mebibyte = int64(1) << 20
	// maxMemoryBytes is far above any GPU; it keeps MiB arithmetic exact and
	// turns typos like "4Ei" into an error instead of an overflow.
	maxMemoryBytes = int64(1) << 50 // 1Pi
	// maxFractionLimitDecimals is SPEC §1's precision for gpu-fraction.limit.
	maxFractionLimitDecimals = 5
)

// Parse reads the GPU-fraction request of a pod as a user submitted it.
// It returns nil and no error when the pod asks for no fraction. Every
// problem found is reported, as an ErrorList.
//
// Parse is for user intent: the keys the scheduler writes after binding
// (.gpus.devices, .gpu-compute.portion) are rejected here.
func Parse(pod *corev1.Pod) ([]Request, error) {
	return ParseTemplate(pod.Annotations, &pod.Spec)
}

// ParseTemplate is Parse for the annotations and spec of a pod template,
// as found in Deployments, Jobs and the other workload kinds.
func ParseTemplate(annotations map[string]string, spec *corev1.PodSpec) ([]Request, error) {
	reqs, _, err := Check(annotations, spec)
	return reqs, err
}

// Check is ParseTemplate with the warnings admission returns (kubectl
// prints them): things KAI Scheduler admits that gpufrac admits too, but
// that probably do not mean what their author thinks, such as a
// gpu-fraction-container-name on a pod that asks for no fraction. A
// warning never stands in for an error: when err is not nil the pod is
// refused, whatever the warnings.
func Check(annotations map[string]string, spec *corev1.PodSpec) (reqs []Request, warnings []string, err error) {
	p := parser{annotations: annotations, spec: spec, canonical: map[string]map[string]string{}}
	req := p.parse()
	for _, w := range p.warnings {
		warnings = append(warnings, w.Error())
	}
	if len(p.errs) > 0 {
		return nil, warnings, p.errs
	}
	if req == nil {
		return nil, warnings, nil
	}
	return []Request{*req}, warnings, nil
}

// parser holds one pod's annotations while they are checked; errs collects
// every problem so the user can fix them all at once.
type parser struct {
	annotations map[string]string
	spec        *corev1.PodSpec
	// canonical maps container → suffix → value for the user-settable keys.
	canonical map[string]map[string]string
	// portionLimits maps container → KAI's portion-limit value.
	portionLimits map[string]string
	// shorthands holds the pod-level keys present.
	shorthands map[string]string
	errs       ErrorList
	warnings   ErrorList
}

func (p *parser) fail(container, key, value, rule string, args ...any) {
	p.errs = append(p.errs, &FieldError{Container: container, Key: key, Value: value, Rule: fmt.Sprintf(rule, args...)})
}

func (p *parser) warn(container, key, value, rule string, args ...any) {
	p.warnings = append(p.warnings, &FieldError{Container: container, Key: key, Value: value, Rule: fmt.Sprintf(rule, args...)})
}

func (p *parser) parse() *Request {
	p.collectKeys()
	if len(p.canonical) == 0 && len(p.shorthands) == 0 && len(p.portionLimits) == 0 {
		return nil
	}
	if v, ok := p.shorthands[KeyContainerName]; ok && len(p.shorthands) == 1 && len(p.canonical) == 0 && len(p.portionLimits) == 0 {
		// Charts often set it on every pod; KAI ignores it without a
		// fraction, and so do we, but say so.
		p.warn("", KeyContainerName, v, "is ignored: the pod asks for no GPU fraction (%s, %s or %s would ask for one)",
			KeyFraction, KeyMemory, ContainerKey("<container>", SuffixMemoryRequest))
		return nil
	}
	p.checkWholeGPUs()
	target, ok := p.target()
	if !ok {
		return nil
	}
	// Values are checked even when the target container is wrong, so that
	// every problem is reported at once.
	return p.request(target)
}

// collectKeys sorts the pod's annotations into canonical and shorthand keys
// and reports keys that are malformed or scheduler-owned.
func (p *parser) collectKeys() {
	keys := make([]string, 0, len(p.annotations))
	for k := range p.annotations {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	p.shorthands = map[string]string{}
	for _, key := range keys {
		value := p.annotations[key]
		if slices.Contains(shorthandKeys, key) {
			p.shorthands[key] = value
			continue
		}
		if rest, kai := strings.CutPrefix(key, KAIContainerKeyPrefix); kai {
			c, found := strings.CutSuffix(rest, SuffixMemoryPortionLimit)
			switch {
			case !found:
				p.fail("", key, value, "is not a known key: KAI Scheduler's per-container key is %s", PortionLimitKey("<container>"))
			case c == "":
				p.fail("", key, value, "names no container: the key is %s", PortionLimitKey("<container>"))
			default:
				if p.portionLimits == nil {
					p.portionLimits = map[string]string{}
				}
				p.portionLimits[c] = value
			}
			continue
		}
		c, suffix, ok := SplitContainerKey(key)
		switch {
		case !ok:
			if near := nearShorthand(key); near != "" {
				p.fail("", key, value, "is not a key gpufrac reads: did you mean %s?", near)
			}
		case c == "":
			p.fail("", key, value, "names no container: per-container keys are %s<container>%s", ContainerKeyPrefix, SuffixMemoryRequest)
		case suffix == "":
			p.fail("", key, value, "is not a known key: per-container keys end in %s", strings.Join(userSuffixes, ", "))
		case slices.Contains(schedulerSuffixes, suffix):
			p.fail(c, key, value, "is written by the scheduler and cannot be set in a manifest: remove it")
		default:
			if p.canonical[c] == nil {
				p.canonical[c] = map[string]string{}
			}
			p.canonical[c][suffix] = value
		}
	}
}

// checkWholeGPUs rejects a fraction on a pod that also asks for whole GPUs:
// the device plugin would hand it a GPU that fractions cannot share.
func (p *parser) checkWholeGPUs() {
	check := func(c corev1.Container) {
		for _, field := range []struct {
			name string
			list corev1.ResourceList
		}{{"resources.limits", c.Resources.Limits}, {"resources.requests", c.Resources.Requests}} {
			if q, ok := field.list[ResourceGPU]; ok && !q.IsZero() {
				p.fail(c.Name, field.name+"["+ResourceGPU+"]", q.String(),
					"cannot be combined with GPU-fraction annotations on the same pod: ask for whole GPUs or for a fraction, not both")
				return
			}
		}
	}
	for _, c := range p.spec.InitContainers {
		check(c)
	}
	for _, c := range p.spec.Containers {
		check(c)
	}
}

// target finds the one container the fraction is for: the container of the
// canonical keys, or the shorthands' gpu-fraction-container-name (default:
// the first container). They must agree, and the container must exist; as
// in KAI, it may be an init container.
func (p *parser) target() (string, bool) {
	var named []string
	for c := range p.canonical {
		named = append(named, c)
	}
	slices.Sort(named)
	for _, c := range named {
		if !p.hasContainer(c) {
			p.fail(c, ContainerKey(c, firstSuffix(p.canonical[c])), p.canonical[c][firstSuffix(p.canonical[c])],
				"names a container that is not in the pod (%s)", p.containerNames())
		}
	}
	if len(p.shorthands) > 0 || len(p.portionLimits) > 0 {
		shorthandTarget, explicit := p.shorthands[KeyContainerName]
		switch {
		case explicit && !p.hasContainer(shorthandTarget):
			p.fail("", KeyContainerName, shorthandTarget, "names a container that is not in the pod (%s)", p.containerNames())
		case !explicit && len(named) == 1:
			// KAI: the container of the canonical keys wins over the
			// default first container.
			shorthandTarget = named[0]
		case !explicit && len(p.spec.Containers) == 0:
			key := firstKey(p.shorthands)
			value := p.shorthands[key]
			if key == "" {
				c := sortedKeys(p.portionLimits)[0]
				key, value = PortionLimitKey(c), p.portionLimits[c]
			}
			p.fail("", key, value, "applies to the first container, but the pod has none")
		case !explicit:
			shorthandTarget = p.spec.Containers[0].Name
		}
		if len(p.shorthands) > 0 && !slices.Contains(named, shorthandTarget) {
			named = append(named, shorthandTarget)
		}
		for _, c := range sortedKeys(p.portionLimits) {
			if c != shorthandTarget {
				p.fail(c, PortionLimitKey(c), p.portionLimits[c], "must name the container %s applies to (%q: %s, or the first container)",
					KeyFraction, shorthandTarget, KeyContainerName)
			}
		}
		if len(named) == 0 {
			named = append(named, shorthandTarget)
		}
	}
	if len(named) > 1 {
		p.fail("", "GPU-fraction containers", strings.Join(named, ", "),
			"are more than one: only one container per pod may have fraction annotations (pod-level keys apply to %s unless %s names another)",
			p.firstContainerName(), KeyContainerName)
		return "", false
	}
	return named[0], true
}

// request parses and cross-checks every value for the target container.
func (p *parser) request(c string) *Request {
	canon := p.canonical[c]
	reqKey, limitKey := ContainerKey(c, SuffixMemoryRequest), ContainerKey(c, SuffixMemoryLimit)
	canonReq, hasCanonReq := p.quantityMiB(c, reqKey, canon, SuffixMemoryRequest, false)
	canonLimit, hasCanonLimit := p.quantityMiB(c, limitKey, canon, SuffixMemoryLimit, false)
	_, canonReqPresent := canon[SuffixMemoryRequest]
	_, canonLimitPresent := canon[SuffixMemoryLimit]
	_, fractionPresent := p.shorthands[KeyFraction]
	_, memoryPresent := p.shorthands[KeyMemory]

	fraction, hasFraction := p.shorthandFraction(c)
	memMiB, hasMem := p.shorthandMemory(c)
	if fractionPresent && memoryPresent {
		p.fail(c, KeyMemory, p.shorthands[KeyMemory], "cannot be combined with %s: ask for a share of a GPU or for an amount of memory, not both", KeyFraction)
	}
	fractionLimit, hasFractionLimit := p.shorthandFractionLimit(c, KeyFractionLimit, p.shorthands, KeyFractionLimit, fraction, hasFraction)
	if v, present := p.portionLimits[c]; present {
		portionLimit, ok := p.shorthandFractionLimit(c, PortionLimitKey(c), p.portionLimits, c, fraction, hasFraction)
		switch {
		case ok && hasFractionLimit && portionLimit.Cmp(fractionLimit) != 0:
			p.fail(c, PortionLimitKey(c), v, "disagrees with %s %q: set one, or make them equal", KeyFractionLimit, p.shorthands[KeyFractionLimit])
		case ok:
			fractionLimit, hasFractionLimit = portionLimit, true
		}
	}
	memLimitMiB, hasMemLimit := p.shorthandMemoryLimit(c, memMiB, hasMem)

	if fractionPresent && canonReqPresent {
		// KAI: the canonical request takes priority over gpu-fraction. A
		// share-of-the-GPU limit then has no share to be above.
		p.warn(c, KeyFraction, p.shorthands[KeyFraction], "is ignored: %s is set too, and the canonical request wins, as in KAI Scheduler", reqKey)
		hasFraction = false
		limits := map[string]string{}
		if v, ok := p.shorthands[KeyFractionLimit]; ok {
			limits[KeyFractionLimit] = v
		}
		if v, ok := p.portionLimits[c]; ok {
			limits[PortionLimitKey(c)] = v
		}
		for _, k := range slices.Sorted(maps.Keys(limits)) {
			p.fail(c, k, limits[k], "cannot be combined with %s: a limit as a share of the GPU needs the request as a share (%s); set %s instead", reqKey, KeyFraction, limitKey)
			hasFractionLimit = false
		}
	}
	if canonLimitPresent {
		// KAI refuses a canonical limit next to a share, and next to
		// gpu-memory unless gpu-memory.limit says the same.
		_, memLimitPresent := p.shorthands[KeyMemoryLimit]
		switch {
		case fractionPresent:
			p.fail(c, limitKey, canon[SuffixMemoryLimit], "cannot be combined with %s %q: a share is resolved to memory by the scheduler; set %s for a limit as a share",
				KeyFraction, p.shorthands[KeyFraction], KeyFractionLimit)
		case memoryPresent && !memLimitPresent:
			p.fail(c, limitKey, canon[SuffixMemoryLimit], "cannot be combined with %s alone: set the limit with %s too (KAI Scheduler refuses this pair)", KeyMemory, KeyMemoryLimit)
		}
	}
	if hasMem && hasCanonReq && memMiB != canonReq {
		p.fail(c, reqKey, canon[SuffixMemoryRequest], "disagrees with %s %q (%dMi vs %dMi): set one, or make them equal", KeyMemory, p.shorthands[KeyMemory], canonReq, memMiB)
	}
	if hasMemLimit && hasCanonLimit && memLimitMiB != canonLimit {
		p.fail(c, limitKey, canon[SuffixMemoryLimit], "disagrees with %s %q (%dMi vs %dMi): set one, or make them equal", KeyMemoryLimit, p.shorthands[KeyMemoryLimit], canonLimit, memLimitMiB)
	}

	mode := p.mode(c, canon)
	devices, hasDevices := p.numDevices(c)

	// Which memory was asked for, and its limit; defaults fill the gaps:
	// no limit means limit = request, a limit alone means request = limit.
	var memory, limit Amount
	switch {
	case hasFraction:
		memory = Amount{Fraction: fraction}
	case hasMem:
		memory = Amount{MiB: memMiB}
	case hasCanonReq:
		memory = Amount{MiB: canonReq}
	}
	switch {
	case hasFractionLimit:
		limit = Amount{Fraction: fractionLimit}
	case hasMemLimit:
		limit = Amount{MiB: memLimitMiB}
	case hasCanonLimit:
		limit = Amount{MiB: canonLimit}
	}
	if memory == (Amount{}) {
		memory = limit
	}
	if limit == (Amount{}) {
		limit = memory
	}

	asked := p.asksForMemory(canon)
	if !asked {
		for _, key := range []string{KeyNumDevices, KeyContainerName, KeyComputeSharingMode} {
			if v, ok := p.shorthands[key]; ok {
				p.fail(c, key, v, "needs a memory request: set %s or %s (or %s)", KeyFraction, KeyMemory, SuffixMemoryRequest)
			}
		}
		if v, ok := canon[SuffixComputeMode]; ok {
			p.fail(c, ContainerKey(c, SuffixComputeMode), v, "needs a memory request: set %s or %s", ContainerKey(c, SuffixMemoryRequest), KeyFraction)
		}
	}
	if !memory.IsFraction() && memory.MiB > 0 && limit.MiB > 0 && limit.MiB < memory.MiB {
		key, value := limitKey, canon[SuffixMemoryLimit]
		if hasMemLimit {
			key, value = KeyMemoryLimit, p.shorthands[KeyMemoryLimit]
		}
		p.fail(c, key, value, "must be at least the memory request (%dMi)", memory.MiB)
	}
	if memory == (Amount{}) {
		return nil
	}
	if !hasDevices {
		devices = 1
	}
	return &Request{Container: c, Memory: memory, Limit: limit, Mode: mode, Devices: devices}
}

// asksForMemory reports whether any key (valid or not) asks for memory, so
// that a bad value is not also reported as a missing request.
func (p *parser) asksForMemory(canon map[string]string) bool {
	for _, k := range []string{KeyFraction, KeyMemory, KeyFractionLimit, KeyMemoryLimit} {
		if _, ok := p.shorthands[k]; ok {
			return true
		}
	}
	_, req := canon[SuffixMemoryRequest]
	_, limit := canon[SuffixMemoryLimit]
	return req || limit || len(p.portionLimits) > 0
}

func (p *parser) shorthandFraction(c string) (Fraction, bool) {
	v, ok := p.shorthands[KeyFraction]
	if !ok {
		return Fraction{}, false
	}
	f, _, err := p.lenientFraction(c, KeyFraction, v)
	switch {
	case errors.Is(err, errNotDecimal) || errors.Is(err, errEmptyDecimal):
		p.fail(c, KeyFraction, v, "must be a decimal number such as 0.5")
	case errors.Is(err, errTooPrecise):
		p.fail(c, KeyFraction, v, "must have at most %d decimal places", maxDecimals)
	case err != nil || f.IsZero() || f.IsOne():
		p.fail(c, KeyFraction, v, "must be greater than 0 and less than 1")
	default:
		return f, true
	}
	return Fraction{}, false
}

// lenientFraction parses a share as KAI does (strconv.ParseFloat), so that
// "5e-1" and "+0.5" are 0.5, but exactly: a form other than a plain
// decimal is read through its shortest decimal rendering, and warned about.
// NaN and Inf are not shares.
func (p *parser) lenientFraction(c, key, v string) (Fraction, int, error) {
	f, written, err := parseFraction(v)
	if !errors.Is(err, errNotDecimal) {
		return f, written, err
	}
	x, perr := strconv.ParseFloat(v, 64)
	if perr != nil || math.IsNaN(x) || math.IsInf(x, 0) {
		return Fraction{}, 0, errNotDecimal
	}
	if x < 0 {
		return Fraction{}, 0, errAboveOne // out of range either way
	}
	plain := strconv.FormatFloat(x, 'f', -1, 64)
	f, written, err = parseFraction(plain)
	if err == nil {
		p.warn(c, key, v, "is read as %s: write it as a plain decimal", plain)
	}
	return f, written, err
}

// shorthandFractionLimit checks a limit written as a share of the GPU,
// values[field] under key: gpu-fraction.limit or KAI's portion limit,
// which follow the same rules.
func (p *parser) shorthandFractionLimit(c, key string, values map[string]string, field string, fraction Fraction, hasFraction bool) (Fraction, bool) {
	v, ok := values[field]
	if !ok {
		return Fraction{}, false
	}
	if _, present := p.shorthands[KeyFraction]; !present {
		p.fail(c, key, v, "needs %s: the limit is a share of the same GPU as the request", KeyFraction)
		return Fraction{}, false
	}
	f, written, err := p.lenientFraction(c, key, v)
	switch {
	case errors.Is(err, errNotDecimal) || errors.Is(err, errEmptyDecimal):
		p.fail(c, key, v, "must be a decimal number such as 0.75")
	case written > maxFractionLimitDecimals || errors.Is(err, errTooPrecise):
		p.fail(c, key, v, "must have at most %d decimal places", maxFractionLimitDecimals)
	case err != nil || f.IsOne() || f.IsZero():
		p.fail(c, key, v, "must be less than 1 and greater than %s", KeyFraction)
	case hasFraction && f.Cmp(fraction) <= 0:
		p.fail(c, key, v, "must be greater than %s (%s) and less than 1", KeyFraction, fraction)
	case !hasFraction:
		// The request itself is invalid and already reported.
	default:
		return f, true
	}
	return Fraction{}, false
}

func (p *parser) shorthandMemory(c string) (int64, bool) {
	v, ok := p.shorthands[KeyMemory]
	if !ok {
		return 0, false
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || !allDigits(v) || n <= 0 {
		p.fail(c, KeyMemory, v, "must be a positive whole number of MiB without a unit, such as 4096")
		return 0, false
	}
	if n > maxMemoryBytes/mebibyte {
		p.fail(c, KeyMemory, v, "must be at most %d MiB (1Pi)", maxMemoryBytes/mebibyte)
		return 0, false
	}
	return n, true
}

func (p *parser) shorthandMemoryLimit(c string, memMiB int64, hasMem bool) (int64, bool) {
	v, ok := p.shorthands[KeyMemoryLimit]
	if !ok {
		return 0, false
	}
	if _, present := p.shorthands[KeyMemory]; !present {
		p.fail(c, KeyMemoryLimit, v, "needs %s: set the memory request too", KeyMemory)
		return 0, false
	}
	mib, ok := p.quantityMiB(c, KeyMemoryLimit, p.shorthands, KeyMemoryLimit, true)
	if !ok || !hasMem {
		return 0, false
	}
	if mib < memMiB {
		p.fail(c, KeyMemoryLimit, v, "must be at least %s (%dMi)", KeyMemory, memMiB)
		return 0, false
	}
	return mib, true
}

// binaryAndDecimalUnits are the quantity suffixes that make sense for bytes.
var binaryAndDecimalUnits = []string{"Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "k", "M", "G", "T", "P", "E"}

// quantityMiB parses values[field] as a memory quantity and returns it in
// whole MiB, rounded up so a guarantee is never smaller than asked.
func (p *parser) quantityMiB(c, key string, values map[string]string, field string, needUnit bool) (int64, bool) {
	v, ok := values[field]
	if !ok {
		return 0, false
	}
	q, err := resource.ParseQuantity(v)
	if err != nil {
		p.fail(c, key, v, "must be a Kubernetes quantity such as 4Gi or 7680Mi")
		return 0, false
	}
	if needUnit && !hasUnit(v) {
		p.fail(c, key, v, "must be a quantity with a unit, such as 8Gi (unlike %s, it is not a number of MiB)", KeyMemory)
		return 0, false
	}
	switch {
	case q.Sign() <= 0:
		p.fail(c, key, v, "must be greater than 0")
	case q.CmpInt64(mebibyte) < 0:
		p.fail(c, key, v, "must be at least 1Mi (a bare number means bytes: write a unit, such as 4Gi)")
	case q.CmpInt64(maxMemoryBytes) > 0:
		p.fail(c, key, v, "must be at most 1Pi")
	default:
		bytes := q.Value() // exact or rounded up, and within int64 here
		return (bytes + mebibyte - 1) / mebibyte, true
	}
	return 0, false
}

func hasUnit(v string) bool {
	for _, u := range binaryAndDecimalUnits {
		if strings.HasSuffix(v, u) {
			return true
		}
	}
	return false
}

func (p *parser) mode(c string, canon map[string]string) ComputeMode {
	mode := TimeSlicing
	key := ContainerKey(c, SuffixComputeMode)
	canonV, hasCanon := canon[SuffixComputeMode]
	if hasCanon {
		m, ok := ParseComputeMode(canonV)
		if !ok {
			p.fail(c, key, canonV, "must be %s or %s", TimeSlicing, SMSharing)
			hasCanon = false
		}
		mode = m
	}
	if v, ok := p.shorthands[KeyComputeSharingMode]; ok {
		m, valid := ParseComputeMode(v)
		switch {
		case !valid:
			p.fail(c, KeyComputeSharingMode, v, "must be %s or %s", TimeSlicing, SMSharing)
		case hasCanon && m != mode:
			p.fail(c, key, canonV, "disagrees with %s %q: set one, or make them equal", KeyComputeSharingMode, v)
		default:
			mode = m
		}
	}
	return mode
}

func (p *parser) numDevices(c string) (int, bool) {
	v, ok := p.shorthands[KeyNumDevices]
	if !ok {
		return 0, false
	}
	n, err := strconv.Atoi(v)
	if err != nil || !allDigits(v) || n < 1 {
		p.fail(c, KeyNumDevices, v, "must be a positive whole number of GPUs, such as 2")
		return 0, false
	}
	return n, true
}

// hasContainer reports whether the pod has a container or an init
// container of that name: KAI gives either a fraction.
func (p *parser) hasContainer(name string) bool {
	for _, list := range [][]corev1.Container{p.spec.InitContainers, p.spec.Containers} {
		for _, c := range list {
			if c.Name == name {
				return true
			}
		}
	}
	return false
}

// containerNames lists the pod's containers for an error message:
// "containers: main, sidecar; init containers: setup".
func (p *parser) containerNames() string {
	names := func(list []corev1.Container) string {
		n := make([]string, len(list))
		for i, c := range list {
			n[i] = c.Name
		}
		return strings.Join(n, ", ")
	}
	out := "containers: none"
	if len(p.spec.Containers) > 0 {
		out = "containers: " + names(p.spec.Containers)
	}
	if len(p.spec.InitContainers) > 0 {
		out += "; init containers: " + names(p.spec.InitContainers)
	}
	return out
}

func (p *parser) firstContainerName() string {
	if len(p.spec.Containers) == 0 {
		return "the first container"
	}
	return strconv.Quote(p.spec.Containers[0].Name)
}

// firstSuffix is the first present suffix of a container's canonical keys,
// in the stable order of userSuffixes.
func firstSuffix(values map[string]string) string {
	for _, s := range userSuffixes {
		if _, ok := values[s]; ok {
			return s
		}
	}
	return ""
}

// sortedKeys is m's keys in order; nil, without allocating, for an empty m.
func sortedKeys(m map[string]string) []string {
	if len(m) == 0 {
		return nil
	}
	return slices.Sorted(maps.Keys(m))
}

func firstKey(m map[string]string) string {
	for _, k := range shorthandKeys {
		if _, ok := m[k]; ok {
			return k
		}
	}
	return ""
}
