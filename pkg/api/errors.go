package api

import (
	"fmt"
	"strconv"
	"strings"
	"unicode"
)

// maxShownValue bounds how much of a bad value an error repeats, so one
// line stays one readable line whatever a manifest holds.
const maxShownValue = 64

// FieldError is one problem with a pod's GPU-fraction request: which
// container, which key, which value, and the rule it breaks.
type FieldError struct {
	// Container is the container the key applies to; "" when the problem
	// is not tied to one container.
	Container string
	// Key is the annotation key (or resource field) at fault.
	Key string
	// Value is the value as written.
	Value string
	// Rule says what must hold, phrased to follow the value.
	Rule string
}

// Error renders one line a person can act on, e.g.
// container "main": gpu-fraction "1" must be greater than 0 and less than 1.
func (e *FieldError) Error() string {
	var b strings.Builder
	if e.Container != "" {
		fmt.Fprintf(&b, "container %q: ", e.Container)
	}
	fmt.Fprintf(&b, "%s %q %s", shownKey(e.Key), shorten(e.Value), escapeUnprintable(e.Rule))
	return b.String()
}

func shorten(s string) string {
	if len(s) > maxShownValue {
		return s[:maxShownValue] + "..."
	}
	return s
}

// shownKey prints a key as is when it is plain text, quoted otherwise, so
// a key holding a newline cannot split the message.
func shownKey(k string) string {
	for _, r := range k {
		if !unicode.IsPrint(r) {
			return strconv.Quote(shorten(k))
		}
	}
	return shorten(k)
}

// ErrorList is every problem found in one pod, in a stable order. Its
// Error is a single line: the problems joined by "; ".
type ErrorList []*FieldError

func (l ErrorList) Error() string {
	msgs := make([]string, len(l))
	for i, e := range l {
		msgs[i] = e.Error()
	}
	return strings.Join(msgs, "; ")
}

// escapeUnprintable replaces control characters that a rule may quote
// from a key with '?', keeping the message on one line.
func escapeUnprintable(s string) string {
	return strings.Map(func(r rune) rune {
		if unicode.IsPrint(r) {
			return r
		}
		return '?'
	}, s)
}
