package api

import (
	"bytes"
	"encoding/json"
	"fmt"
)

// SharesHeldAnnotation is what the scheduler writes on a standing
// reservation pod (LabelStandingGPUs): what annotation shares hold of its
// GPU. The node's DRA driver offers claims only the rest, so that
// kube-scheduler's DRA allocator, which reads only the node's slices,
// never gives a claim what an annotation pod holds. The scheduler keeps it
// current; a pod without it, or with one that cannot be read, offers no
// claim anything (the node fails closed).
const SharesHeldAnnotation = "gpufrac.io/annotation-shares"

// SharesHeld is the value of SharesHeldAnnotation.
type SharesHeld struct {
	// MemoryMiB is the annotation shares' summed requests.
	MemoryMiB int64 `json:"memoryMiB"`
	// Mode is theirs; empty when there are none.
	Mode ComputeMode `json:"mode,omitempty"`
	// Portion is their summed sm-sharing compute, in thousandths.
	Portion int64 `json:"portion,omitempty"`
}

// String is the annotation's value.
func (h SharesHeld) String() string {
	b, _ := json.Marshal(h) // a struct of numbers and a string cannot fail
	return string(b)
}

// ParseSharesHeld reads SharesHeldAnnotation's value: unknown fields,
// negative amounts, an unknown mode or a portion above a GPU are errors.
func ParseSharesHeld(s string) (SharesHeld, error) {
	var h SharesHeld
	dec := json.NewDecoder(bytes.NewReader([]byte(s)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&h); err != nil {
		return SharesHeld{}, fmt.Errorf("annotation %s %q: %w", SharesHeldAnnotation, s, err)
	}
	switch {
	case dec.More():
		return SharesHeld{}, fmt.Errorf("annotation %s %q: one JSON object expected", SharesHeldAnnotation, s)
	case h.MemoryMiB < 0 || h.Portion < 0 || h.Portion > 1000:
		return SharesHeld{}, fmt.Errorf("annotation %s %q: memoryMiB must be at least 0 and portion from 0 to 1000", SharesHeldAnnotation, s)
	case h.Mode != "" && h.Mode != TimeSlicing && h.Mode != SMSharing:
		return SharesHeld{}, fmt.Errorf("annotation %s %q: mode must be %s or %s", SharesHeldAnnotation, s, TimeSlicing, SMSharing)
	case h.Mode == TimeSlicing && h.Portion != 0:
		return SharesHeld{}, fmt.Errorf("annotation %s %q: time-slicing shares hold no compute portion", SharesHeldAnnotation, s)
	}
	return h, nil
}
